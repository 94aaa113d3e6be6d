"""The projection of 4- and 8-bit weights (W4A16, W8A16) in minisgl's packed layout
(minisgl.kernels.packed) on the GPU, behind one custom op.

    torch.ops.minisgl.packed_linear(x, qweight, scales, zeros, perm, bias, bits) -> y

- `packed_gemv` (1 to `GEMV_MAX_ROWS` rows, the CUDA cores): a program owns `BLOCK_N` output rows and
  sweeps their words contiguously; the j-th value of every word multiplies x's columns word * P + j
  (no unpacked tile is rearranged), and each word's scale and zero point apply once to its sum. One
  row of x takes two-dimensional tiles only (`_packed_gemv_kernel`); 2 to 4 rows share each tile
  (`_packed_gemv_rows_kernel`).
- Every kernel reads a value as the float 2^bits + u (`_biased`: one shift and one mask-and-or) and
  takes 2^bits away with the zero point.
- `packed_mma` (to `MMA_MAX_ROWS` rows, the tensor cores, for weights wide enough to give every SM
  two programs, `mma_fills`): a tile of words dequantized in registers, value by value as in the
  GEMV, and multiplied with x's matching columns (`tl.dot`); the weight is read from memory once per
  64 rows of x. On an H100 it beats dequantize-then-cuBLAS only there (Qwen3-8B's gate/up at 8 to 32
  rows: 119 to 141 us against 180); on narrower weights its 64 to 96 programs leave SMs idle.
- `packed_gemm` (more rows: prefill): the weight dequantized into a buffer of x's dtype (a Triton
  kernel), then cuBLAS. The buffer is one per device and dtype (`reserve_workspace`, made at load at
  the size of the model's largest packed weight), so no call allocates it: a CUDA graph's pool never
  holds a copy of it.

The op picks by row count when it runs (one compiled graph for every batch size, nothing read on the
host: CUDA-graph safe). Elsewhere (the CPU, no Triton) it dequantizes and multiplies: the reference.
docs/quantization.md ("The GPU kernels").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.kernels.packed import dequantize
from minisgl.kernels.pdl import launch_options, pdl_enabled, sm_count

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves
    triton = None

# the most rows the GEMV (CUDA cores) takes; then the tensor-core GEMM to MMA_MAX_ROWS where it fills
# the card (`mma_fills`); the rest run dequantize-then-cuBLAS (prefill: the dequantization paid once
# for many rows)
GEMV_MAX_ROWS = 4
MMA_MAX_ROWS = 32


if triton is not None:

    @triton.jit
    def _tile(
        q_ptr, s_ptr, z_ptr, rows, row_mask, words, KW, G,
        PACK: tl.constexpr, GROUP_WORDS: tl.constexpr,
    ):  # fmt: skip
        """The words (BLOCK_N, BLOCK_W) of `rows` x `words` and each word's scale and zero point, float32,
        the zero point biased by 2^bits as `_biased`'s values are (a word's values lie in one group:
        GROUP_WORDS = group / PACK words)."""
        mask = row_mask[:, None] & (words < KW)[None, :]
        q = tl.load(q_ptr + rows[:, None] * KW + words[None, :], mask=mask, other=0)
        at = rows[:, None] * G + (words // GROUP_WORDS)[None, :]
        s = tl.load(s_ptr + at, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + at, mask=mask, other=0).to(tl.float32) + (1 << (32 // PACK))
        return q, s, z

    @triton.jit
    def _x_slice(
        x_ptr, perm_ptr, ms, m_mask, words, KW, x_stride, j, PACK: tl.constexpr, HAS_PERM: tl.constexpr
    ):
        """x's columns words * PACK + j (the j-th value of each word), rows `ms`: (BLOCK_M, BLOCK_W)."""
        cols = words * PACK + j
        col_mask = words < KW
        if HAS_PERM:
            cols = tl.load(perm_ptr + cols, mask=col_mask, other=0)
        at = x_ptr + ms.to(tl.int64)[:, None] * x_stride + cols.to(tl.int64)[None, :]
        return tl.load(at, mask=m_mask[:, None] & col_mask[None, :], other=0.0)

    @triton.jit
    def _store(acc, b_ptr, y_ptr, ms, rows, M, N, HAS_BIAS: tl.constexpr):
        """Adds the bias (float32) and stores the rows `ms` x `rows` of y, rounded once."""
        row_mask = rows < N
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + ms.to(tl.int64)[:, None] * N + rows[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(ms < M)[:, None] & row_mask[None, :])

    @triton.jit
    def _weight_rows(N, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
        """The program's weight rows (axis 0), their mask and int64 copy; with PDL, lets the next kernel
        launch and waits for the previous one's results (minisgl.kernels.pdl)."""
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        return rows, rows < N, rows.to(tl.int64)

    @triton.jit
    def _biased(q, J: tl.constexpr, BITS: tl.constexpr):
        """The J-th value u of each word as the float32 2^BITS + u: u moved into the top bits of the
        mantissa of 2^BITS, one shift and one mask-and-or a value (no conversion, no subtraction: the
        callers take the bias away with the zero point, which `_tile` returns biased)."""
        SHIFT: tl.constexpr = 23 - BITS - J * BITS
        if SHIFT >= 0:
            v = q << SHIFT
        else:
            v = q >> -SHIFT
        return ((v & (((1 << BITS) - 1) << (23 - BITS))) | ((127 + BITS) << 23)).to(tl.float32, bitcast=True)

    @triton.jit
    def _biased_at(q, shift, BITS: tl.constexpr):
        """`_biased` for the values at bit `shift` (a tensor) of the words."""
        u = ((q >> shift) & ((1 << BITS) - 1)) << (23 - BITS)
        return (u | ((127 + BITS) << 23)).to(tl.float32, bitcast=True)

    @triton.jit
    def _packed_dot(
        q_ptr, s_ptr, z_ptr, rows, row_mask, x_ptr, KW, G,
        BITS: tl.constexpr, GROUP_WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    ):  # fmt: skip
        """The products (BLOCK_N,) float32 of the weight's `rows` with one vector x (its columns in the
        packed order, from x_ptr), as the GEMV computes them: per word, (sum_j u_j x_j - z sum_j x_j) s
        (the MoE experts' few-token kernels, minisgl.kernels.moe_gemv)."""
        PACK: tl.constexpr = 32 // BITS
        acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        for w0 in range(0, KW, BLOCK_W):
            words = w0 + tl.arange(0, BLOCK_W)
            q, s, z = _tile(q_ptr, s_ptr, z_ptr, rows, row_mask, words, KW, G, PACK, GROUP_WORDS)
            ux = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
            xs = tl.zeros([BLOCK_W], dtype=tl.float32)
            for j in tl.static_range(PACK):
                x = tl.load(x_ptr + words * PACK + j, mask=words < KW, other=0.0).to(tl.float32)
                ux += _biased(q, j, BITS) * x[None, :]
                xs += x
            acc += (ux - z * xs[None, :]) * s
        return tl.sum(acc, axis=1)

    @triton.jit
    def _packed_gemv_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, N, KW, G,
        BITS: tl.constexpr, GROUP_WORDS: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """One row of x: a program owns `BLOCK_N` outputs, in two-dimensional tiles only (`_packed_dot`)."""
        rows, row_mask, rows64 = _weight_rows(N, BLOCK_N, USE_PDL)
        y = _packed_dot(
            q_ptr, s_ptr, z_ptr, rows64, row_mask, x_ptr, KW, G, BITS, GROUP_WORDS, BLOCK_N, BLOCK_W
        )
        _store(y[None, :], b_ptr, y_ptr, tl.arange(0, 1), rows, 1, N, HAS_BIAS)

    @triton.jit
    def _packed_gemv_rows_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, perm_ptr, b_ptr, y_ptr, M, N, KW, G, x_stride,
        BITS: tl.constexpr, GROUP_WORDS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """Every row of x (2 to 4) in one program: the weight's tile read once for them all."""
        PACK: tl.constexpr = 32 // BITS
        rows, row_mask, rows64 = _weight_rows(N, BLOCK_N, USE_PDL)
        ms = tl.arange(0, BLOCK_M)
        m_mask = ms < M
        # per word: (sum_j u_j x_j - z sum_j x_j) s, summed over the words once, after the loop
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_W], dtype=tl.float32)
        for w0 in range(0, KW, BLOCK_W):
            words = w0 + tl.arange(0, BLOCK_W)
            q, s, z = _tile(q_ptr, s_ptr, z_ptr, rows64, row_mask, words, KW, G, PACK, GROUP_WORDS)
            ux = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_W], dtype=tl.float32)
            xs = tl.zeros([BLOCK_M, BLOCK_W], dtype=tl.float32)
            for j in tl.static_range(PACK):
                u = _biased(q, j, BITS)
                x = _x_slice(x_ptr, perm_ptr, ms, m_mask, words, KW, x_stride, j, PACK, HAS_PERM).to(
                    tl.float32
                )
                ux += x[:, None, :] * u[None, :, :]
                xs += x
            acc += (ux - z[None, :, :] * xs[:, None, :]) * s[None, :, :]
        _store(tl.sum(acc, axis=2), b_ptr, y_ptr, ms, rows, M, N, HAS_BIAS)

    @triton.jit
    def _mma_words(acc, q, s, z, x_rows, m_mask, words, KW, BITS: tl.constexpr):
        """acc (BLOCK_N, BLOCK_M) plus the tile of words q (BLOCK_N, BLOCK_W) with their scales and zero
        points, dequantized value by value ((u - z) s in float32, rounded to x's dtype as the reference
        does), times x's matching columns: x de-interleaved (x[:, j * KW + word] = column
        word * PACK + j), its rows at `x_rows` (BLOCK_M, 1). The weight is the MMA's long side."""
        PACK: tl.constexpr = 32 // BITS
        zs = z * s  # (u - z) s as one fused multiply-add: exact for 16-bit scales, as is z s
        for j in tl.static_range(PACK):
            at = x_rows + (j * KW + words)[None, :]
            x = tl.load(at, mask=m_mask[:, None] & (words < KW)[None, :], other=0.0)
            w = tl.fma(_biased(q, j, BITS), s, -zs).to(x.dtype)
            acc = tl.dot(w, tl.trans(x), acc)
        return acc

    @triton.jit
    def _packed_mma_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, KW, G, x_stride,
        BITS: tl.constexpr, GROUP_WORDS: tl.constexpr, HAS_BIAS: tl.constexpr, RESHAPE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """The tensor-core GEMM: a program owns `BLOCK_N` output columns (weight rows) and `BLOCK_M` rows
        of x, whose columns are in the weight's order (act order applied). Each step dequantizes a
        (BLOCK_N, BLOCK_W) tile of words in float32, rounds it to x's dtype as the reference does and
        multiplies: the weight's rows are the MMA's long side (y^T = W x^T), which fills the tensor
        cores' tile at few rows of x. RESHAPE: the tile's values unpacked into the columns' order
        (BLOCK_N, BLOCK_W * PACK), one product with x's contiguous columns; else value by value, the
        j-th values of the words against x given de-interleaved (x[:, j * KW + word] = column
        word * PACK + j: contiguous loads)."""
        PACK: tl.constexpr = 32 // BITS
        rows, row_mask, rows64 = _weight_rows(N, BLOCK_N, USE_PDL)
        ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = ms < M
        x_rows = x_ptr + ms.to(tl.int64)[:, None] * x_stride
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for w0 in range(0, KW, BLOCK_W):
            words = w0 + tl.arange(0, BLOCK_W)
            q, s, z = _tile(q_ptr, s_ptr, z_ptr, rows64, row_mask, words, KW, G, PACK, GROUP_WORDS)
            if RESHAPE:
                js = tl.arange(0, PACK)
                u = _biased_at(q[:, :, None], (js * BITS)[None, None, :], BITS)
                w = tl.reshape((u - z[:, :, None]) * s[:, :, None], (BLOCK_N, BLOCK_W * PACK))
                cols = w0 * PACK + tl.arange(0, BLOCK_W * PACK)
                x = tl.load(
                    x_rows + cols[None, :], mask=m_mask[:, None] & (cols < KW * PACK)[None, :], other=0.0
                )
                acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
            else:
                acc = _mma_words(acc, q, s, z, x_rows, m_mask, words, KW, BITS)
        _store(tl.trans(acc), b_ptr, y_ptr, ms, rows, M, N, HAS_BIAS)

    @triton.jit
    def _dequantize_kernel(
        q_ptr, s_ptr, z_ptr, w_ptr, N, KW, G,
        BITS: tl.constexpr, GROUP_WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    ):  # fmt: skip
        """W (N, K) in w's dtype from the packed layout, (u - z) s computed in float32, rounded once."""
        PACK: tl.constexpr = 32 // BITS
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        rows64 = rows.to(tl.int64)
        words = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        q, s, z = _tile(q_ptr, s_ptr, z_ptr, rows64, row_mask, words, KW, G, PACK, GROUP_WORDS)
        js = tl.arange(0, PACK)
        w = (_biased_at(q[:, :, None], (js * BITS)[None, None, :], BITS) - z[:, :, None]) * s[:, :, None]
        cols = words[:, None] * PACK + js[None, :]
        out = w_ptr + rows64[:, None, None] * (KW * PACK) + cols[None, :, :]
        mask = row_mask[:, None, None] & (words < KW)[None, :, None]
        tl.store(out, w.to(w_ptr.dtype.element_ty), mask=mask)


def _shape(qweight, scales, bits) -> tuple[int, int, int, int]:
    """(N, words a row, groups a row, words a group) of a packed weight (a group is a multiple of 32 /
    bits columns)."""
    n, words = qweight.shape
    groups = max(scales.shape[1], 1)
    return n, words, groups, words // groups


def gemv_config(m: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_W, warps) of the GEMV for m rows: fewer words a step as the rows grow (registers);
    from the sweeps of docs/quantization.md ("The GPU kernels")."""
    return (16, 128, 4) if m <= 1 else (16, 64, 4) if m <= 2 else (16, 32, 4)


def packed_gemv(x, qweight, scales, zeros, perm, bias, bits, pdl: bool | None = None) -> torch.Tensor:
    """x (M, K), 1 <= M <= GEMV_MAX_ROWS, times the packed weight (N, K)^T (+ bias) -> (M, N) in x's dtype:
    one row on `_packed_gemv_kernel` (x permuted first for act order), more on `_packed_gemv_rows_kernel`."""
    n, words, g, group_words = _shape(qweight, scales, bits)
    m = x.shape[0]
    if m == 1 and perm is not None:
        x, perm = x.index_select(1, perm), None
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = x.new_empty(m, n)
    block_n, block_w, warps = gemv_config(m)
    use_pdl = pdl_enabled(x) if pdl is None else pdl
    dummy = qweight  # pointer arguments the kernel does not read
    bias_arg = dummy if bias is None else bias
    common = dict(
        BITS=bits, GROUP_WORDS=group_words, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_W=block_w,
        num_warps=warps, **launch_options(use_pdl),
    )  # fmt: skip
    if m == 1:
        _packed_gemv_kernel[(triton.cdiv(n, block_n),)](
            x, qweight, scales, zeros, bias_arg, y, n, words, g, **common
        )
    else:
        _packed_gemv_rows_kernel[(triton.cdiv(n, block_n),)](
            x, qweight, scales, zeros, dummy if perm is None else perm, bias_arg, y, m, n, words, g,
            x.stride(0), HAS_PERM=perm is not None, BLOCK_M=triton.next_power_of_2(m), **common,
        )  # fmt: skip
    return y


def mma_config(m: int) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_W, warps, stages, RESHAPE) of the tensor-core GEMM for m rows: x's rows
    in one block to 64 (the weight read once), then blocks of 64; the rest from the sweep of
    docs/quantization.md ("The GPU kernels": value by value, x de-interleaved, at 16 and 32 rows)."""
    return (max(16, triton.next_power_of_2(min(m, 64))), 64, 32, 4, 3, False)


def mma_fills(n: int, device: torch.device) -> bool:
    """Whether a weight of n rows gives the tensor-core GEMM at least two programs per SM of `device`."""
    return triton.cdiv(n, mma_config(1)[1]) >= 2 * sm_count(device)


def packed_mma(x, qweight, scales, zeros, perm, bias, bits, pdl: bool | None = None) -> torch.Tensor:
    """x (M, K) times the packed weight (N, K)^T (+ bias) -> (M, N) in x's dtype on the tensor cores,
    the weight dequantized tile by tile in registers (`_packed_mma_kernel`)."""
    n, words, g, group_words = _shape(qweight, scales, bits)
    m = x.shape[0]
    block_m, block_n, block_w, warps, stages, reshape = mma_config(m)
    if perm is not None:
        x = x.index_select(1, perm)
    if not reshape:  # de-interleaved: the j-th values' columns together
        x = x.view(m, words, 32 // bits).transpose(1, 2)
    x = x.contiguous()
    y = x.new_empty(m, n)
    use_pdl = pdl_enabled(x) if pdl is None else pdl
    _packed_mma_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x, qweight, scales, zeros, qweight if bias is None else bias, y, m, n, words, g, x.stride(0),
        BITS=bits, GROUP_WORDS=group_words, HAS_BIAS=bias is not None, RESHAPE=reshape,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_W=block_w,
        num_warps=warps, num_stages=stages, **launch_options(use_pdl),
    )  # fmt: skip
    return y


_WORKSPACE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def reserve_workspace(numel: int, dtype: torch.dtype, device: torch.device) -> int:
    """Grows the dequantized-weight buffer of `device` and `dtype` to `numel` values (the process keeps
    it; engines on the device share it, their forwards never overlap). Returns the bytes it grew by."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the key a tensor's own device gives
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype)
    have = _WORKSPACE.get(key)
    if have is not None and have.numel() >= numel:
        return 0
    _WORKSPACE.pop(key, None)
    _WORKSPACE[key] = torch.empty(numel, dtype=dtype, device=device)
    return (numel - (0 if have is None else have.numel())) * _WORKSPACE[key].element_size()


def packed_gemm(x, qweight, scales, zeros, perm, bias, bits) -> torch.Tensor:
    """x (M, K) times the packed weight (N, K)^T (+ bias) -> (M, N) in x's dtype: the weight dequantized
    into the workspace of x's device and dtype (`_dequantize_kernel`), then cuBLAS."""
    n, words, g, group_words = _shape(qweight, scales, bits)
    k = words * 32 // bits
    reserve_workspace(n * k, x.dtype, x.device)  # a no-op once the model's load reserved it
    w = _WORKSPACE[(x.device, x.dtype)][: n * k].view(n, k)
    block_n, block_w = 16, 64
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(words, block_w))](
        qweight, scales, zeros, w, n, words, g, BITS=bits, GROUP_WORDS=group_words,
        BLOCK_N=block_n, BLOCK_W=block_w, num_warps=4,
    )  # fmt: skip
    if perm is not None:
        x = x.index_select(1, perm)
    return F.linear(x, w, bias)


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
    the tensor-core GEMM to `MMA_MAX_ROWS` where it fills the card, dequantize-then-cuBLAS else."""
    if 1 <= x.shape[0] <= GEMV_MAX_ROWS:
        return packed_gemv(x, qweight, scales, zeros, perm, bias, bits)
    if x.shape[0] <= MMA_MAX_ROWS and mma_fills(qweight.shape[0], x.device):
        return packed_mma(x, qweight, scales, zeros, perm, bias, bits)
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
