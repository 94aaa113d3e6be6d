"""The projection of 4- and 8-bit weights (W4A16, W8A16) in minisgl's packed layout
(minisgl.kernels.packed) on the GPU: two Triton kernels behind one custom op.

    torch.ops.minisgl.packed_linear(x, qweight, scales, zeros, perm, bias, bits) -> y

- `packed_gemv` (1 to `GEMV_MAX_ROWS` rows): a program owns `BLOCK_N` output rows and sweeps K,
  reading each row's words contiguously, unpacking and dequantizing them in registers ((u - zero) x
  scale in float32) and multiplying every row of x at once on the CUDA cores; the next step's weights
  are loaded before this step's products (the first before PDL's `gdc_wait`).
- `packed_gemm` (more rows): tiles of x (BLOCK_M x BLOCK_K) times a tile of weights dequantized to x's
  dtype in registers (BLOCK_K x BLOCK_N), `tl.dot` on the tensor cores, a float32 accumulator.

The op picks by row count when it runs (one compiled graph for every batch size, nothing read on the
host: CUDA-graph safe). Elsewhere (the CPU, no Triton) it dequantizes and multiplies: the reference.
docs/quantization.md ("The GPU kernels").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.kernels.packed import dequantize
from minisgl.kernels.pdl import launch_options, pdl_enabled

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves
    triton = None

# the most rows the GEMV takes; more run the GEMM
GEMV_MAX_ROWS = 16


if triton is not None:

    @triton.jit
    def _weights(
        q_ptr, s_ptr, z_ptr, rows, row_mask, k0, K, G, GROUP,
        BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """The dequantized weights of `rows` x columns [k0, k0 + BLOCK_K), float32 (BLOCK_N, BLOCK_K)."""
        PACK: tl.constexpr = 32 // BITS
        words_k = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
        mask = row_mask[:, None] & (words_k < K // PACK)[None, :]
        words = tl.load(q_ptr + rows[:, None] * (K // PACK) + words_k[None, :], mask=mask, other=0)
        shifts = tl.arange(0, PACK) * BITS
        u = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        u = tl.reshape(u, (BLOCK_N, BLOCK_K))
        cols = k0 + tl.arange(0, BLOCK_K)
        at = rows[:, None] * G + (cols // GROUP)[None, :]
        smask = row_mask[:, None] & (cols < K)[None, :]
        s = tl.load(s_ptr + at, mask=smask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + at, mask=smask, other=0).to(tl.float32)
        return (u.to(tl.float32) - z) * s

    @triton.jit
    def _store(acc, b_ptr, y_ptr, ms, rows, M, N, HAS_BIAS: tl.constexpr):
        """Adds the bias (float32) and stores the rows `ms` x `rows` of y, rounded once."""
        row_mask = rows < N
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + ms.to(tl.int64)[:, None] * N + rows[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(ms < M)[:, None] & row_mask[None, :])

    @triton.jit
    def _x_cols(perm_ptr, cols, mask, HAS_PERM: tl.constexpr):
        if HAS_PERM:
            return tl.load(perm_ptr + cols, mask=mask, other=0)
        return cols

    @triton.jit
    def _packed_gemv_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, perm_ptr, b_ptr, y_ptr, M, N, K, G, GROUP, x_stride,
        BITS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        if USE_PDL:  # minisgl.kernels.pdl: the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        rows64 = rows.to(tl.int64)
        ms = tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        w = _weights(q_ptr, s_ptr, z_ptr, rows64, row_mask, 0, K, G, GROUP, BITS, BLOCK_N, BLOCK_K)
        if USE_PDL:  # the first weights are loaded: now wait for the input rows
            tl.extra.cuda.gdc_wait()
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < K
            xc = _x_cols(perm_ptr, cols, col_mask, HAS_PERM)
            x_mask = (ms < M)[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + ms[:, None] * x_stride + xc[None, :], mask=x_mask, other=0.0).to(tl.float32)
            w_next = _weights(
                q_ptr, s_ptr, z_ptr, rows64, row_mask, k0 + BLOCK_K, K, G, GROUP, BITS, BLOCK_N, BLOCK_K
            )
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
            w = w_next
        _store(acc, b_ptr, y_ptr, ms, rows, M, N, HAS_BIAS)

    @triton.jit
    def _packed_gemm_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, perm_ptr, b_ptr, y_ptr, M, N, K, G, GROUP, x_stride, BITS: tl.constexpr,
        HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        rows64 = rows.to(tl.int64)
        m_mask = ms < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < K
            xc = _x_cols(perm_ptr, cols, col_mask, HAS_PERM)
            x_at = x_ptr + ms.to(tl.int64)[:, None] * x_stride + xc[None, :]
            x = tl.load(x_at, mask=m_mask[:, None] & col_mask[None, :], other=0.0)
            w = _weights(q_ptr, s_ptr, z_ptr, rows64, row_mask, k0, K, G, GROUP, BITS, BLOCK_N, BLOCK_K)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
        _store(acc, b_ptr, y_ptr, ms, rows, M, N, HAS_BIAS)


def _common(x, qweight, scales, perm, bias, bits):
    n, k = qweight.shape[0], qweight.shape[1] * 32 // bits
    if x.stride(-1) != 1:
        x = x.contiguous()
    groups = scales.shape[1]
    y = x.new_empty(x.shape[0], n)
    dummy = qweight  # pointer arguments the kernel does not read
    args = (perm if perm is not None else dummy, bias if bias is not None else dummy, y)
    return x, y, (n, k, groups, k // max(groups, 1), x.stride(0)), args


def gemv_config(m: int, n: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of the GEMV for m rows: fewer columns per step as the rows grow (registers)."""
    return (4, 256) if m <= 2 else (4, 128) if m <= 4 else (8, 64)


def packed_gemv(x, qweight, scales, zeros, perm, bias, bits, pdl: bool | None = None) -> torch.Tensor:
    """x (M, K), 1 <= M <= GEMV_MAX_ROWS, times the packed weight (N, K)^T (+ bias) -> (M, N) in x's dtype."""
    x, y, (n, k, g, group, stride), args = _common(x, qweight, scales, perm, bias, bits)
    m = x.shape[0]
    block_n, block_k = gemv_config(m, n)
    use_pdl = pdl_enabled(x) if pdl is None else pdl
    _packed_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, qweight, scales, zeros, *args, m, n, k, g, group, stride,
        BITS=bits, HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
        BLOCK_M=max(triton.next_power_of_2(m), 1), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4, **launch_options(use_pdl),
    )  # fmt: skip
    return y


def gemm_config(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) of the GEMM by row count."""
    if m <= 32:
        return 32, 64, 64, 4
    if m <= 64:
        return 64, 64, 64, 4
    return 128, 128, 64, 8


def packed_gemm(x, qweight, scales, zeros, perm, bias, bits) -> torch.Tensor:
    """x (M, K) times the packed weight (N, K)^T (+ bias) -> (M, N) in x's dtype, on the tensor cores."""
    x, y, (n, k, g, group, stride), args = _common(x, qweight, scales, perm, bias, bits)
    m = x.shape[0]
    if m == 0:
        return y
    bm, bn, bk, warps = gemm_config(m)
    _packed_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, qweight, scales, zeros, *args, m, n, k, g, group, stride,
        BITS=bits, HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=3,
    )  # fmt: skip
    return y


def packed_reference(x, qweight, scales, zeros, perm, bias, bits) -> torch.Tensor:
    """Dequantize (float32, rounded to x's dtype once), then multiply: the reference."""
    return F.linear(x, dequantize(qweight, scales, zeros, bits, perm, x.dtype), bias)


Tensor = torch.Tensor


@torch.library.custom_op("minisgl::packed_linear", mutates_args=())
def packed_linear_op(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor,
    perm: Tensor | None,
    bias: Tensor | None,
    bits: int,
) -> Tensor:
    """x (T, K) times the packed weight (N, K)^T (+ bias) -> (T, N): the GEMV to `GEMV_MAX_ROWS` rows,
    the GEMM beyond."""
    if 1 <= x.shape[0] <= GEMV_MAX_ROWS:
        return packed_gemv(x, qweight, scales, zeros, perm, bias, bits)
    return packed_gemm(x, qweight, scales, zeros, perm, bias, bits)


@packed_linear_op.register_fake
def _(x, qweight, scales, zeros, perm, bias, bits):
    return x.new_empty(x.shape[0], qweight.shape[0])


def packed_linear(x, qweight, scales, zeros, perm, bias, bits) -> torch.Tensor:
    """x (..., K) times the packed weight (N, K)^T (+ bias): the op on CUDA, the reference elsewhere."""
    if triton is None or not x.is_cuda:
        return packed_reference(x, qweight, scales, zeros, perm, bias, bits)
    shape = x.shape
    y = packed_linear_op(x.reshape(-1, shape[-1]), qweight, scales, zeros, perm, bias, bits)
    return y.reshape(*shape[:-1], y.shape[-1])
