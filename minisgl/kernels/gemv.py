"""A linear layer of a few rows (y = x W^T + b for x of 1 to `GEMV_MAX_ROWS` rows) as a Triton kernel,
with `add_rms_norm_gemv` and `silu_mul_gemv` prologues.

cuBLAS reads small matrices well below HBM bandwidth at one row; here each program owns whole output
rows, sweeps all of K at once and reduces in float32, reading the weights once whatever the row count.
The custom ops of `minisgl.kernels.linear` call these by row count. docs/gpu.md ("One-row GEMV").
"""

from __future__ import annotations

import torch

from minisgl.kernels.pdl import launch_options, pdl_enabled

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: F.linear serves every shape
    triton = None

# the widest row (K) the kernel takes; its sweep is unrolled, so this bounds the code size
MAX_K = 16384
# the most rows the kernel takes (the ops send it fewer: `minisgl.kernels.linear.gemv_rows`)
GEMV_MAX_ROWS = 16


def _block_n(n: int) -> int:
    """Output rows per program: two on wide matrices, one on narrow ones (one program per row keeps
    every SM busy on narrow matrices). Chosen by `python -m perf.gpu.gemv --sweep`; see
    docs/performance.md."""
    return 2 if n >= 4096 else 1


def gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when the kernel can multiply a row of x by `weight`: CUDA, bf16/fp16, a contiguous weight
    of at most `MAX_K` columns. Says nothing of x's row count, so that a compiled graph whose batch
    dimension is symbolic can ask it (the ops of `minisgl.kernels.linear` check the rows when they run)."""
    return (
        triton is not None
        and x.is_cuda
        and x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.shape[1] == x.shape[1]
        and weight.shape[1] <= MAX_K
        and weight.is_contiguous()
    )


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, max_rows: int = 1) -> bool:
    """True when x has 1 to `max_rows` rows that the kernel can multiply by `weight` (`gemv_fits`)."""
    return gemv_fits(x, weight) and 1 <= x.shape[0] <= min(max_rows, GEMV_MAX_ROWS)


# the kernel's prologues: what it does to the row before multiplying
PLAIN, ADD_RMS_NORM, SILU_MUL = 0, 1, 2

if triton is not None:

    @triton.jit
    def _prologue(
        x_at, residual_at, residual_out_at, norm_ptr, cols, mask, col_mask, K, PROLOGUE, HAS_RESIDUAL, STORE
    ):
        """The rows of x at x_at (a [BLOCK_K] or [BLOCK_M, BLOCK_K] block of pointers) as the GEMV
        multiplies them, in float32, and their squares for the norm (ADD_RMS_NORM; zeros otherwise)."""
        if PROLOGUE == 2:  # SILU_MUL: a row is [gate | up], 2 K wide
            gate = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(x_at + K, mask=mask, other=0.0).to(tl.float32)
            x = gate * tl.sigmoid(gate) * up
            return x, x * 0.0
        x = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
        if PROLOGUE == 1:  # ADD_RMS_NORM: the caller scales by rstd after the sweep
            if HAS_RESIDUAL:  # the new residual: stored rounded, normalised in float32
                x = x + tl.load(residual_at, mask=mask, other=0.0).to(tl.float32)
            if STORE:  # one program writes the new residual stream
                tl.store(residual_out_at, x.to(residual_out_at.dtype.element_ty), mask=mask)
            return x * tl.load(norm_ptr + cols, mask=col_mask, other=0.0).to(tl.float32), x * x
        return x, x * 0.0

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        residual_ptr,
        norm_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        residual_out_ptr,
        normed_out_ptr,
        N,
        M,
        x_stride,
        eps,
        K: tl.constexpr,
        PROLOGUE: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        STORE_NORMED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pid = tl.program_id(0)  # the block of output rows, for every row of x at once
        if USE_PDL:  # see minisgl.kernels.pdl: the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        row_start = rows.to(tl.int64) * K
        ms = tl.arange(0, BLOCK_M)  # the rows of x
        m_mask = ms < M
        # one row: products (BLOCK_N, BLOCK_K); several: (BLOCK_M, BLOCK_N, BLOCK_K), the weight block
        # loaded once for all of them
        if BLOCK_M == 1:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
            sum_sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < K
            w = tl.load(
                w_ptr + row_start[:, None] + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            if USE_PDL:
                if k0 == 0:  # the first block of weights is in flight: now wait for the input rows
                    tl.extra.cuda.gdc_wait()
            if BLOCK_M == 1:
                x, sq = _prologue(
                    x_ptr + cols, residual_ptr + cols, residual_out_ptr + cols, norm_ptr, cols, col_mask,
                    col_mask, K, PROLOGUE, HAS_RESIDUAL, pid == 0,
                )  # fmt: skip
                acc += w.to(tl.float32) * x[None, :]
            else:
                at = ms[:, None] * K + cols[None, :]
                x, sq = _prologue(
                    x_ptr + ms[:, None] * x_stride + cols[None, :], residual_ptr + at, residual_out_ptr + at,
                    norm_ptr, cols[None, :], m_mask[:, None] & col_mask[None, :], col_mask[None, :], K,
                    PROLOGUE, HAS_RESIDUAL, pid == 0,
                )  # fmt: skip
                acc += w.to(tl.float32)[None, :, :] * x[:, None, :]
            sum_sq += sq
        if BLOCK_M == 1:
            y = tl.sum(acc, axis=1)  # (BLOCK_N,)
            rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)
            if PROLOGUE == 1:
                y = y * rstd
        else:
            y = tl.sum(acc, axis=2)  # (BLOCK_M, BLOCK_N)
            rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / K + eps)
            if PROLOGUE == 1:
                y = y * rstd[:, None]
        if STORE_NORMED:  # ADD_RMS_NORM: program 0 also stores the normalised rows, (h * w) * rstd
            if pid == 0:
                for k0 in tl.static_range(0, K, BLOCK_K):
                    cols = k0 + tl.arange(0, BLOCK_K)
                    col_mask = cols < K
                    if BLOCK_M == 1:
                        at = cols
                        x, _ = _prologue(
                            x_ptr + at, residual_ptr + at, residual_out_ptr + at, norm_ptr, cols, col_mask,
                            col_mask, K, PROLOGUE, HAS_RESIDUAL, False,
                        )  # fmt: skip
                        x = x * rstd
                        mask = col_mask
                    else:
                        at = ms[:, None] * K + cols[None, :]
                        mask = m_mask[:, None] & col_mask[None, :]
                        x, _ = _prologue(
                            x_ptr + ms[:, None] * x_stride + cols[None, :], residual_ptr + at,
                            residual_out_ptr + at, norm_ptr, cols[None, :], mask, col_mask[None, :], K,
                            PROLOGUE, HAS_RESIDUAL, False,
                        )  # fmt: skip
                        x = x * rstd[:, None]
                    tl.store(normed_out_ptr + at, x.to(normed_out_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        if BLOCK_M == 1:
            tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)
        else:
            out_mask = m_mask[:, None] & row_mask[None, :]
            tl.store(y_ptr + ms[:, None] * N + rows[None, :], y.to(y_ptr.dtype.element_ty), mask=out_mask)


def gemv_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    block_n: int,
    block_k: int,
    num_warps: int,
    prologue: int = PLAIN,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    eps: float = 0.0,
    pdl: bool = False,
    normed_out: torch.Tensor | None = None,
) -> None:
    """Launches the kernel with an explicit configuration (the benchmark sweeps these) on the rows of x
    (contiguous; `residual` too), into `out` (rows, n); `pdl`: with programmatic dependent launch
    (`minisgl.kernels.pdl`); `normed_out` (ADD_RMS_NORM): also the normalised rows, (rows, k)."""
    n, k = weight.shape
    m = x.shape[0]
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"the GEMV kernel takes 1 to {GEMV_MAX_ROWS} rows, got {m}; use F.linear")
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        weight,
        bias if bias is not None else weight,
        out,
        residual_out if residual_out is not None else out,
        normed_out if normed_out is not None else out,
        n,
        m,
        x.stride(0),
        eps,
        K=k,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        STORE_NORMED=normed_out is not None,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        **launch_options(pdl),
    )


def _config(m: int, n: int, k: int, prologue: int = PLAIN) -> tuple[int, int, int]:
    """(block_n, block_k, warps) for m rows of x, an (n, k) weight and the kernel's prologue, chosen by
    sweeps on an H200 (`python -m perf.gpu.gemv --sweep`); the rules and why: docs/gpu.md#one-row-gemv,
    the measurements: docs/performance.md#one-row-gemv-at-17b-to-30b-shapes-issue-44."""
    block_k = min(1024, triton.next_power_of_2(k))
    if m > 1:
        return 4, block_k, 4
    if prologue == SILU_MUL:
        return (4, block_k, 4) if n >= 2048 else (2, block_k, 8)
    if prologue == PLAIN and k >= 4096 and n <= 16384:
        return 1, block_k, 8
    return _block_n(n), block_k, 4


def _launch(x, weight, bias, out, **prologue) -> None:
    config = _config(x.shape[0], *weight.shape, prologue.get("prologue", PLAIN))
    gemv_launch(x, weight, bias, out, *config, pdl=pdl_enabled(x), **prologue)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T (+ bias (N,)) -> (M, N), on the Triton kernel."""
    out = x.new_empty(x.shape[0], weight.shape[0])
    _launch(x.contiguous(), weight, bias, out)
    return out


def add_rms_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    keep_normed: bool = False,
) -> tuple[torch.Tensor, ...]:
    """`add_rms_norm` and `linear` of each row in one kernel: h = x + residual (x when residual is None),
    y = (h / rms(h) * norm_weight) @ weight^T (+ bias). Returns (y (M, N), h (M, K)); with
    `keep_normed`, (y, the normalised rows (M, K), h): one program writes them after its sweep, for a
    second consumer (a MoE layer's experts beside its router).

    The norm's scale is applied to the dot products, after the sweep (each program reads the whole row
    anyway), so the normalised row is never rounded to the model's dtype as the unfused path rounds it;
    the norm reads the float32 sum x + residual (h, the new residual, is stored rounded)."""
    out = x.new_empty(x.shape[0], weight.shape[0])
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    normed = torch.empty_like(residual_out) if keep_normed else None
    residual = None if residual is None else residual.contiguous()
    prologue = dict(residual=residual, norm_weight=norm_weight, residual_out=residual_out, eps=eps)
    _launch(x.contiguous(), weight, bias, out, prologue=ADD_RMS_NORM, normed_out=normed, **prologue)
    return (out, normed, residual_out) if keep_normed else (out, residual_out)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU-and-multiply and `linear` of each row in one kernel: gate_up (M, 2 K) = [gate | up] ->
    (silu(gate) * up) @ weight (N, K)^T, (M, N). The product is not rounded to the model's dtype."""
    out = gate_up.new_empty(gate_up.shape[0], weight.shape[0])
    _launch(gate_up.contiguous(), weight, None, out, prologue=SILU_MUL)
    return out
