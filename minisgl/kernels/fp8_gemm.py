"""The FP8 projection on the GPU: Triton kernels and `torch._scaled_mm` for block-scaled e4m3 weights.

`fp8_linear` sends CUDA tensors the kernels take (`fp8_kernels_fit`) to the op `minisgl::fp8_linear`
(a GEMV, the Triton GEMM or cuBLASLt, chosen by rows) and everything else to the float32 emulation
`minisgl.kernels.fp8.fp8_linear`, the reference. Kernels, fused quantizers, numerics and timings:
docs/quantization.md ("The GPU GEMM").
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from minisgl.compile import gemv_kernel_mode
from minisgl.kernels.fp8 import FP8_DTYPE, FP8_MAX, INV_FP8_MAX, MIN_AMAX
from minisgl.kernels.fp8 import fp8_linear as emulated_fp8_linear
from minisgl.kernels.gemv import ADD_RMS_NORM, PLAIN, SILU_MUL
from minisgl.kernels.pdl import launch_options, pdl_enabled

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the emulation serves every call
    triton = None

# the only activation group and weight block width the kernels take
GROUP = 128
# the widest row (K) the GEMV takes: its sweep is unrolled (K / 128 steps), so this bounds the code size
MAX_K = 16384
# the most rows the GEMV kernel takes (its BLOCK_M); the op's threshold is GEMV_MAX_ROWS
GEMV_ROWS_LIMIT = 16
# columns a GEMV step reads (`_gemv_block_k`)
GEMV_BLOCK_K = 512
# rows up to this run the GEMV, more the GEMM (module-level: perf/gpu/fp8_gemm.py switches it). On an
# H200 at Qwen3-8B's shapes the GEMV took 0.56-0.69x bf16 cuBLAS's time at 1 row, 0.83-0.90x at 2, and was
# 2-5x slower than the GEMMs at 4 (docs/quantization.md)
GEMV_MAX_ROWS = 2
# the GEMM for more rows: "scaled_mm" (cuBLASLt, the Triton GEMM where it is refused) or "triton"
GEMM_BACKEND = "scaled_mm"
# whether the layers send an FP8 projection's norm and SiLU-and-multiply to the fused ops
# (`minisgl::fp8_norm_linear`, `minisgl::fp8_silu_mul_linear`), which write e4m3 rows and their scales
# once instead of a separate quantization: Qwen3-8B FP8, one request on an H200, 285 -> 311 tok/s
# (docs/quantization.md); False puts the unfused layers back (perf/gpu/fp8_fused.py compares the two)
FUSED_QUANTIZE = True
# Triton GEMM tile configurations (BLOCK_M, BLOCK_N, num_warps, num_stages), picked by M: the first
# whose BLOCK_M covers M, else the last; INVARIANT_CONFIG for `invariant` (every row count alike)
GEMM_CONFIGS: list[tuple[int, int, int, int]] = [(16, 64, 4, 4), (64, 128, 4, 4), (128, 128, 8, 3)]
INVARIANT_CONFIG = (64, 128, 4, 4)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


if triton is not None:
    _FP8_MAX = tl.constexpr(FP8_MAX)
    _MIN_AMAX = tl.constexpr(MIN_AMAX)
    _INV_FP8_MAX = tl.constexpr(INV_FP8_MAX)

    @triton.jit
    def _round_e4m3(v):
        """v (float32, within +-448) rounded to the nearest e4m3 value (ties to even), in float32: adding
        and subtracting 1.5 * 2^(e + 23), where 2^e is e4m3's spacing at v's magnitude (2^-9 at least:
        the subnormals), rounds v to a multiple of 2^e in float32's own round-to-nearest-even."""
        bits = v.to(tl.int32, bitcast=True)
        exponent = (bits >> 23) & 0xFF
        spacing = tl.maximum(exponent - 130, -9)  # (exponent - 127) - 3 mantissa bits
        magic = (((spacing + 150) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
        r = (v + magic) - magic
        # a value that rounds to zero keeps its sign, as the conversion keeps it
        return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)

    @triton.jit
    def _round_bf16(y):
        """y (float32) rounded to the nearest bf16 value (ties to even), in float32 (the interpreter's
        conversion truncates)."""
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _quantize_tile(x):
        """x (R, GROUP) float32, one group per row -> (e4m3 values (R, GROUP), float32 scales (R,)):
        scale = max(amax, MIN_AMAX) x float32(1 / 448), x / scale (correctly rounded) clamped to +-448
        and rounded to nearest even, as `minisgl.kernels.fp8.quantize_groups` computes it."""
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.maximum(amax, _MIN_AMAX) * _INV_FP8_MAX  # as quantize_blocks: times the reciprocal
        v = tl.math.div_rn(x, scale[:, None])
        v = tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX)
        # rounded here on every device: the conversion then only changes the format. (The interpreter's
        # conversion rounds wrongly; on an H200, Triton's gave other bytes than torch's for some values.)
        v = _round_e4m3(v)
        return v.to(tl.float8e4nv), scale

    @triton.jit
    def _round_to(v, dtype: tl.constexpr, ROUND_BF16: tl.constexpr):
        """v (float32) rounded to `dtype` (nearest even) and back to float32: an op's result as torch
        stores it in x's dtype (ROUND_BF16: rounded in float32 first, for the interpreter)."""
        if ROUND_BF16:
            v = _round_bf16(v)
        return v.to(dtype).to(tl.float32)

    @triton.jit
    def _store_rows(
        x, out_ptr, s_ptr, row, groups, cols, M, K, GROUP_SIZE: tl.constexpr, QUANTIZE: tl.constexpr
    ):
        """Stores x (float32, the row's `groups` at `cols`; zeros past K) quantized in `quantize_rows`'
        layout: e4m3 (M, K) row-major at out_ptr, float32 scales (M, groups) column-major (strides
        (1, M)) at s_ptr; without QUANTIZE, as it is in out_ptr's dtype (M, K)."""
        if QUANTIZE:
            q, scale = _quantize_tile(x)
            tl.store(out_ptr + row * K + cols, q, mask=cols < K)
            tl.store(s_ptr + groups * M + row, scale, mask=groups * GROUP_SIZE < K)
        else:
            tl.store(out_ptr + row * K + cols, x.to(out_ptr.dtype.element_ty), mask=cols < K)

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        M,
        K,
        x_row_stride,
        GROUPS: tl.constexpr,
        GROUP_SIZE: tl.constexpr,
        PROLOGUE: tl.constexpr,
        r_ptr,
        w_ptr,
        h_ptr,
        HAS_RESIDUAL: tl.constexpr,
        r_row_stride,
        eps,
        inv_k,
        ROUND_BF16: tl.constexpr,
        INTERPRET: tl.constexpr,
        QUANTIZE: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        # a program: GROUPS groups of a row (ADD_RMS_NORM: all of them). PROLOGUE (the numbering of
        # minisgl.kernels.gemv): PLAIN quantizes x; ADD_RMS_NORM and SILU_MUL compute, as the eager
        # layers do, `add_rms_norm` (x + the residual at r_ptr, optional; the new residual stored at
        # h_ptr; the norm weight at w_ptr) or `F.silu(gate) * up` (x = [gate | up], 2 K wide), each
        # op's result rounded to x's dtype where torch rounds it; then quantize (QUANTIZE) or store
        row = tl.program_id(0).to(tl.int64)
        groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        cols = groups[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
        mask = cols < K
        dtype: tl.constexpr = x_ptr.dtype.element_ty
        if USE_PDL:  # see minisgl.kernels.pdl: the next kernel (the GEMV) may launch now
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if PROLOGUE == 1:  # ADD_RMS_NORM
            if HAS_RESIDUAL:  # residual + x, in x's dtype
                r = tl.load(r_ptr + row * r_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
                x = _round_to(x + r, dtype, ROUND_BF16)
            tl.store(h_ptr + row * K + cols, x.to(dtype), mask=mask)
            # x32.pow(2).mean(-1): the squares are exact; torch divides their sum by K on the CPU and
            # multiplies it by float32(1 / K) on CUDA (the sum's order is its own: see norm_quantize_rows)
            total = tl.sum(tl.sum(x * x, axis=1), axis=0)
            if INTERPRET:
                mean = tl.math.div_rn(total, K.to(tl.float32))
            else:
                mean = total * inv_k
            x = _round_to(x * tl.rsqrt(mean + eps), dtype, ROUND_BF16)  # x32 * rsqrt(..), .to(x.dtype)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            x = _round_to(w * x, dtype, ROUND_BF16)  # weight * normed, in x's dtype
        if PROLOGUE == 2:  # SILU_MUL: F.silu(gate), rounded, then times up, rounded
            up = tl.load(x_ptr + row * x_row_stride + K + cols, mask=mask, other=0.0).to(tl.float32)
            if INTERPRET:
                e = tl.exp(-x)
            else:  # expf, as torch's CUDA kernel calls it (tl.exp is an approximation)
                e = tl.extra.cuda.libdevice.exp(-x)
            x = _round_to(tl.math.div_rn(x, 1.0 + e), dtype, ROUND_BF16)  # x / (1 + exp(-x)), as torch
            x = _round_to(x * up, dtype, ROUND_BF16)
        _store_rows(x, q_ptr, s_ptr, row, groups, cols, M, K, GROUP_SIZE, QUANTIZE)

    @triton.jit
    def _fp8_gemv_kernel(
        xq_ptr,
        xs_ptr,
        w_ptr,
        s_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K: tl.constexpr,
        SCALE_BLOCK_N: tl.constexpr,
        SCALE_BLOCK_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_SIZE: tl.constexpr,
        ROUND_BF16: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        # xq (M, K) e4m3 and xs (M, ceil(K / GROUP_SIZE)) column-major: `quantize_rows`' output
        pid = tl.program_id(0)
        if USE_PDL:  # see minisgl.kernels.pdl: the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        KB: tl.constexpr = (K + SCALE_BLOCK_K - 1) // SCALE_BLOCK_K  # weight scale columns
        XG: tl.constexpr = (K + GROUP_SIZE - 1) // GROUP_SIZE  # activation groups
        G: tl.constexpr = BLOCK_K // GROUP_SIZE  # groups a step covers
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        w_rows = rows.to(tl.int64) * K
        s_rows = (rows // SCALE_BLOCK_N) * KB
        tokens = tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < K
            w = tl.load(
                w_ptr + w_rows[:, None] + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            groups = k0 // GROUP_SIZE + tl.arange(0, G)
            group_mask = groups < XG
            w_scale = tl.load(
                s_ptr + s_rows[:, None] + (groups * GROUP_SIZE // SCALE_BLOCK_K)[None, :],
                mask=row_mask[:, None] & group_mask[None, :],
                other=0.0,
            )
            if USE_PDL:
                if k0 == 0:  # the first block of weights is in flight: now wait for the activations
                    tl.extra.cuda.gdc_wait()
            wf = w.to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                # (m < M as tensors: a scalar condition is no mask the interpreter takes)
                x_mask = col_mask & (cols * 0 + m < M)
                xq = tl.load(xq_ptr + m * K + cols, mask=x_mask, other=0.0).to(tl.float32)
                x_scale = tl.load(xs_ptr + groups * M + m, mask=group_mask & (groups * 0 + m < M), other=0.0)
                # each group's e4m3 products (exact in float32) summed, then scaled once by both scales
                part = tl.sum(tl.reshape(wf * xq[None, :], (BLOCK_N, G, GROUP_SIZE)), axis=2)
                y_m = tl.sum(part * w_scale * x_scale[None, :], axis=1)
                acc += tl.where(tokens[None, :] == m, y_m[:, None], 0.0)
        y = acc
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        if ROUND_BF16:
            y = _round_bf16(y)
        out = y_ptr + tokens[None, :].to(tl.int64) * N + rows[:, None]
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & (tokens < M)[None, :])

    @triton.jit
    def _fp8_gemm_kernel(
        a_ptr,
        a_scale_ptr,
        w_ptr,
        s_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        SCALE_BLOCK_N: tl.constexpr,
        SCALE_BLOCK_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ROUND_BF16: tl.constexpr,
    ):
        # programs of one column of tiles are neighbours: they read the same weight tiles
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        pid_m = pid % tiles_m
        pid_n = pid // tiles_m
        KB = tl.cdiv(K, BLOCK_K)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]  # (BLOCK_K, BLOCK_N) of W^T
        a_scale_ptrs = a_scale_ptr + offs_m  # column-major: + k block * M
        w_scale_ptrs = s_ptr + (offs_n // SCALE_BLOCK_N) * tl.cdiv(K, SCALE_BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in tl.range(0, KB):
            k_mask = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            a_scale = tl.load(a_scale_ptrs + kb * M, mask=m_mask, other=0.0)
            w_scale = tl.load(w_scale_ptrs + kb * BLOCK_K // SCALE_BLOCK_K, mask=n_mask, other=0.0)
            partial = tl.dot(a, b)  # float32: this step's 128 columns
            acc += partial * a_scale[:, None] * w_scale[None, :]
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if ROUND_BF16:
            acc = _round_bf16(acc)
        out = y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def block_fits(block: tuple[int, int], group: int, k: int) -> bool:
    """True when the kernels take weights in blocks of `block` (rows, columns) with activation groups of
    `group` columns, K = k: groups of 128, blocks of any rows and of a multiple of 128 columns or of
    all k columns (per-tensor and per-row scales)."""
    block_n, block_k = block
    return group == GROUP and block_n >= 1 and block_k >= 1 and (block_k % GROUP == 0 or block_k >= k)


def _check_operands(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], group: int = GROUP
) -> None:
    """Raises ValueError unless x (M, K), weight (N, K) e4m3 contiguous and scale (ceil(N / block[0]),
    ceil(K / block[1])) float32 contiguous fit together, in a format the kernels take (`block_fits`)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8 GEMM: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if weight.dtype != FP8_DTYPE or not weight.is_contiguous():
        raise ValueError(f"fp8 GEMM: the weight must be contiguous {FP8_DTYPE}, got {weight.dtype}")
    n, k = weight.shape
    if not block_fits(block, group, k):
        raise ValueError(
            f"fp8 GEMM: the kernels take activation groups of {GROUP} and weight blocks of a multiple of "
            f"{GROUP} columns (or all {k}), got group {group} and block {tuple(block)}"
        )
    expected = (_cdiv(n, block[0]), _cdiv(k, block[1]))
    if tuple(scale.shape) != expected or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(
            f"fp8 GEMM: scale must be contiguous float32 {expected} for weight {(n, k)} in blocks of "
            f"{tuple(block)}, got {scale.dtype} {tuple(scale.shape)}"
        )


def _row_major(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x (M, K), its rows contiguous (a copy where they are not); ValueError unless x is 2-D."""
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be 2-D (rows, K), got {tuple(x.shape)}")
    return _row_major(x)


def _quantize_launch(
    x: torch.Tensor, m: int, k: int, prologue: int = PLAIN, quantize: bool = True, eps: float = 0.0, **args
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs `_quantize_rows_kernel` on m rows of x (k columns after the prologue): (e4m3 (m, k), float32
    scales (m, ceil(k / 128)) strides (1, m)); without `quantize`, (the rows in x's dtype, the scales
    unwritten). A program takes up to 8 groups of a row, all of them for ADD_RMS_NORM. `eps`, `args`:
    ADD_RMS_NORM's (`r_ptr`, `w_ptr`, `h_ptr`, `HAS_RESIDUAL`, `r_row_stride`)."""
    groups = _cdiv(k, GROUP)
    q = torch.empty(m, k, dtype=FP8_DTYPE if quantize else x.dtype, device=x.device)
    scales = torch.empty_strided((m, groups), (1, m), dtype=torch.float32, device=x.device)
    if m and k:
        whole_rows = prologue == ADD_RMS_NORM
        per_program = triton.next_power_of_2(groups) if whole_rows else min(8, triton.next_power_of_2(groups))
        interpret = _interpreting()
        args = {"r_ptr": x, "w_ptr": x, "h_ptr": x, "HAS_RESIDUAL": False, "r_row_stride": 0, **args}
        _quantize_rows_kernel[(m, _cdiv(groups, per_program))](
            x,
            q,
            scales,
            m,
            k,
            x.stride(0),
            GROUPS=per_program,
            GROUP_SIZE=GROUP,
            PROLOGUE=prologue,
            eps=eps,
            inv_k=1.0 / k,
            ROUND_BF16=interpret and x.dtype == torch.bfloat16,
            INTERPRET=interpret,
            QUANTIZE=quantize,
            num_warps=4 if not whole_rows or k <= 4096 else 8 if k <= 8192 else 16,
            enable_fp_fusion=False,  # no a * b + c as one rounding (fma): torch rounds both, in two ops
            **args,
            **launch_options(prologue != PLAIN and pdl_enabled(x)),
        )
    return q, scales


def quantize_rows(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) bf16/fp16/fp32 -> (e4m3 (M, K), float32 scales (M, ceil(K / group)) with strides (1, M)):
    the numbers of `minisgl.kernels.fp8.quantize_groups`, in one Triton kernel."""
    if group != GROUP:
        raise ValueError(f"quantize_rows: group must be {GROUP}, got {group}")
    x = _rows(x, "quantize_rows")
    return _quantize_launch(x, *x.shape)


def _norm_rows(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, quantize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`norm_quantize_rows`, or (quantize False) the normalised rows in x's dtype, their scales
    unwritten, and h."""
    x = _rows(x, "norm_quantize_rows")
    m, k = x.shape
    if (residual is not None and residual.shape != x.shape) or norm_weight.shape != (k,):
        raise ValueError(
            f"norm_quantize_rows: residual {None if residual is None else tuple(residual.shape)} and "
            f"norm weight {tuple(norm_weight.shape)} do not fit x {tuple(x.shape)}"
        )
    residual = x if residual is None else _row_major(residual)
    h = x.new_empty(m, k)
    q, scales = _quantize_launch(
        x,
        m,
        k,
        ADD_RMS_NORM,
        quantize,
        r_ptr=residual,
        w_ptr=norm_weight.contiguous(),
        h_ptr=h,
        HAS_RESIDUAL=residual is not x,
        r_row_stride=residual.stride(0),
        eps=eps,
    )
    return q, scales, h


def norm_quantize_rows(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm of h = residual + x (of x where residual is None), quantized: (e4m3 (M, K), float32 scales
    as `quantize_rows` lays them out, h (M, K) in x's dtype: a copy of x without residual), in one
    Triton kernel, a program a row. The numbers of `minisgl.layers.basic.add_rms_norm` (`rms_norm`)
    then `quantize_rows`: the sum and the normalised row rounded to x's dtype, then the norm weight's
    product, as torch rounds them (norm_weight in x's dtype). The sum of squares is the one float32
    sum that torch adds in an order of its own: where the two sums differ in the last place, an element
    can round to its neighbour (see docs/quantization.md)."""
    return _norm_rows(x, residual, norm_weight, eps, True)


def _silu_mul_rows(gate_up: torch.Tensor, quantize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul_quantize_rows`, or (quantize False) the product in gate_up's dtype, its scales
    unwritten."""
    gate_up = _rows(gate_up, "silu_mul_quantize_rows")
    if gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul_quantize_rows: gate_up must have an even width, got {gate_up.shape[1]}")
    return _quantize_launch(gate_up, gate_up.shape[0], gate_up.shape[1] // 2, SILU_MUL, quantize)


def silu_mul_quantize_rows(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up of gate_up (M, 2 K) = [gate | up], quantized: (e4m3 (M, K), float32 scales as
    `quantize_rows` lays them out), in one Triton kernel. The numbers of `F.silu(gate) * up` in x's
    dtype then `quantize_rows`: the SiLU rounded, then the product (torch's exp on CUDA, NumPy's under
    the interpreter, against torch's vectorized one on the CPU: see docs/quantization.md)."""
    return _silu_mul_rows(gate_up, True)


def gemv_config(m: int, n: int) -> tuple[int, int]:
    """(output rows per program, warps) of the GEMV for m activation rows and n output rows: fewer
    output rows per program as m grows, and fewer on narrow matrices so that every SM has programs.
    `python -m perf.gpu.fp8_gemm --sweep` times the others."""
    block_m = triton.next_power_of_2(m)
    block_rows = 4 if block_m <= 2 else 2
    if n < 2048:
        block_rows = max(1, block_rows // 2)
    return block_rows, 4


def _gemv_block_k(k: int, n: int) -> int:
    """Columns a GEMV step reads: 512 (four groups), fewer for narrow rows, never below a group; 1,024
    on weights of at least 4,096 columns and at most 4,096 rows (Qwen3-8B's O and down on an H200: 7.4
    -> 7.1 and 17.8 -> 16.7 us, `python -m perf.gpu.fp8_gemm --rows 1 --sweep`; wider weights, QKV and
    gate/up, read 512 as fast or faster)."""
    if k >= 4096 and n <= 4096:
        return 1024
    return max(GROUP, min(GEMV_BLOCK_K, triton.next_power_of_2(k)))


def gemv_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    out: torch.Tensor,
    block_rows: int,
    num_warps: int,
    pdl: bool = False,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_k: int | None = None,
) -> None:
    """Quantizes x (`quantize_rows`; or takes `quantized`, x quantized by a fused quantizer), then
    launches the GEMV with an explicit configuration (the benchmark sweeps these; `block_k`, the columns
    a step reads, a multiple of the group: `_gemv_block_k` by default) into `out` (M, N);
    x (M, K), M <= GEMV_ROWS_LIMIT."""
    m, k = x.shape
    n = weight.shape[0]
    xq, xs = quantized if quantized is not None else quantize_rows(x)
    _fp8_gemv_kernel[(triton.cdiv(n, block_rows),)](
        xq,
        xs,
        weight,
        scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        K=k,
        SCALE_BLOCK_N=block[0],
        SCALE_BLOCK_K=block[1],
        HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_rows,
        BLOCK_K=block_k or _gemv_block_k(k, n),
        GROUP_SIZE=GROUP,
        ROUND_BF16=_interpreting() and out.dtype == torch.bfloat16,
        num_warps=num_warps,
        **launch_options(pdl),
    )


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x (M, K) @ W^T (+ bias) -> (M, N) in `out_dtype` (x's by default), M <= 16, for the FP8 weight
    W = `weight` (N, K) e4m3 with scales `scale` (ceil(N / block[0]), ceil(K / block[1])); x is quantized
    per token group of 128 first (`quantize_rows`), or `quantized` is x quantized (e4m3, scales in
    `quantize_rows`' layout: a fused quantizer's outputs; x then gives the shape, dtype and device)."""
    _check_operands(x, weight, scale, block)
    m, k = x.shape
    if m > GEMV_ROWS_LIMIT:
        raise ValueError(f"fp8_gemv takes at most {GEMV_ROWS_LIMIT} rows, got {m}")
    if k > MAX_K:
        raise ValueError(f"fp8_gemv takes rows of at most {MAX_K} columns, got {k}")

    def launch(out: torch.Tensor) -> None:
        block_rows, warps = gemv_config(m, weight.shape[0])
        gemv_launch(x, weight, scale, block, bias, out, block_rows, warps, pdl_enabled(x), quantized)

    return _product(x, weight, bias, out_dtype, launch)


def _product(x, weight, bias, out_dtype, launch: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """The (M, N) output of x (M, K) @ W^T (+ bias) in `out_dtype` (x's by default): `launch(out)` fills
    it where M, N and K are all non-zero; with K = 0 it is the bias alone (or zeros)."""
    m, k = x.shape
    out = torch.empty(m, weight.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    if m and k and weight.shape[0]:
        launch(out)
    elif m and weight.shape[0]:
        out.copy_(torch.zeros_like(out) if bias is None else bias.expand_as(out))
    return out


def gemm_config(m: int) -> tuple[int, int, int, int]:
    """The Triton GEMM's (BLOCK_M, BLOCK_N, num_warps, num_stages) for m rows (`GEMM_CONFIGS`)."""
    for config in GEMM_CONFIGS:
        if m <= config[0]:
            return config
    return GEMM_CONFIGS[-1]


def gemm_launch(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: tuple[int, int, int, int],
) -> None:
    """Launches the Triton GEMM on quantized activations (`quantize_rows`: contiguous e4m3 and
    column-major scales) with an explicit configuration (BLOCK_M, BLOCK_N, num_warps, num_stages) into
    `out` (M, N)."""
    m, k = xq.shape
    n = weight.shape[0]
    block_m, block_cols, warps, stages = config
    _fp8_gemm_kernel[(triton.cdiv(m, block_m) * triton.cdiv(n, block_cols),)](
        xq,
        x_scale,
        weight,
        scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        SCALE_BLOCK_N=block[0],
        SCALE_BLOCK_K=block[1],
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_cols,
        BLOCK_K=GROUP,
        ROUND_BF16=_interpreting() and out.dtype == torch.bfloat16,
        num_warps=warps,
        num_stages=stages,
    )


def fp8_gemm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int, int] | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x (M, K) @ W^T (+ bias) -> (M, N) in `out_dtype` (x's by default) on the Triton GEMM: x quantized
    by `quantize_rows` (or `quantized`, its result), `config` by M (`gemm_config`) unless given."""
    _check_operands(x, weight, scale, block)

    def launch(out: torch.Tensor) -> None:
        xq, xs = quantized if quantized is not None else quantize_rows(x)
        gemm_launch(xq, xs, weight, scale, block, bias, out, config or gemm_config(x.shape[0]))

    return _product(x, weight, bias, out_dtype, launch)


# torch._scaled_mm takes row counts of a multiple of this only (it refuses others: the activation scales'
# column stride, M floats, must be 16-byte aligned); `fp8_gemm_scaled_mm` pads the rows with zeros
# instead, so that every row count from 3 runs cuBLASLt (an H200, torch 2.11 + CUDA 13: 1 to 17 rows
# padded, within the GEMMs' bound of the emulation)
SCALED_MM_ROWS = 4
# ... and weights of a multiple of this many 128-column blocks: cuBLASLt reads the 128x128 weight scales
# (`scale.t()`, strides (1, ceil(K / 128))) as if that stride were 16-byte aligned, and torch does not
# check it: on the H200 a 512 x 256 weight (2 blocks a row) gave errors 75 times the output's largest
# magnitude, silently. Other weights run the Triton GEMM (`scaled_mm_fits`)
SCALED_MM_BLOCKS = 4
# torch._scaled_mm: per (device, M, N, K, dtype, bias): the weight-scale layout it took, or None where it
# refused every one (then the Triton GEMM runs)
_scaled_mm_layouts: dict[tuple, str | None] = {}
# the layouts of the 128x128 weight scales tried, in order. scale_b, for mat_b = W^T (K, N), is
# (ceil(K / 128), ceil(N / 128)): recent torch checks that its transpose is row-major (`scale.t()`, a
# view); a version that wants it row-major itself gets a copy at each call
_SCALE_B_LAYOUTS = ("transposed_view", "contiguous")


def _scale_b(scale: torch.Tensor, layout: str) -> torch.Tensor:
    return scale.t() if layout == "transposed_view" else scale.t().contiguous()


def _scaled_mm(xq, xs, weight, scale, bias, out_dtype, layout) -> torch.Tensor:
    return torch._scaled_mm(
        xq, weight.t(), scale_a=xs, scale_b=_scale_b(scale, layout), bias=bias, out_dtype=out_dtype
    )


def _scaled_mm_key(device, rows, weight, out_dtype, bias) -> tuple:
    return (device, rows, *weight.shape, out_dtype, bias is not None)


def _probe_scaled_mm(xq, xs, weight, scale, bias, out_dtype) -> tuple[str | None, torch.Tensor | None]:
    """Tries `torch._scaled_mm` with each weight-scale layout, once per device, shape, dtype and bias
    (cached): (the layout it took, or None where it refused them all or torch has none; the product of
    the call that succeeded, so that no call is wasted, or None)."""
    key = _scaled_mm_key(xq.device, xq.shape[0], weight, out_dtype, bias)
    if key in _scaled_mm_layouts:
        return _scaled_mm_layouts[key], None
    found, out = None, None
    if hasattr(torch, "_scaled_mm") and xq.is_cuda:
        for layout in _SCALE_B_LAYOUTS:
            try:
                out = _scaled_mm(xq, xs, weight, scale, bias, out_dtype, layout)
            except (RuntimeError, ValueError, NotImplementedError, TypeError):
                continue
            found = layout
            break
    _scaled_mm_layouts[key] = found
    return found, out


def scaled_mm_layout(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> str | None:
    """The weight-scale layout `torch._scaled_mm` takes for these operands, or None where it refuses
    them all (or torch has no `_scaled_mm`, or they are not on CUDA). Tried on the first call per device,
    shape, dtype and bias, then cached: later calls do not try."""
    return _probe_scaled_mm(xq, xs, weight, scale, bias, out_dtype)[0]


def scaled_mm_fits(weight: torch.Tensor) -> bool:
    """True when cuBLASLt reads this weight's 128x128 scales right (`SCALED_MM_BLOCKS`)."""
    return _cdiv(weight.shape[1], GROUP) % SCALED_MM_BLOCKS == 0


def fp8_gemm_scaled_mm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (M, K) @ W^T (+ bias) -> (M, N) in x's dtype through `torch._scaled_mm` (1x128 activation
    scales, 128x128 weight scales); the Triton GEMM where torch refuses these operands
    (`scaled_mm_layout`) or misreads them (`scaled_mm_fits`). The weight must be in 128x128 blocks.
    x's rows are padded with zero rows to a multiple of `SCALED_MM_ROWS` (their products dropped)."""
    block = (GROUP, GROUP)
    _check_operands(x, weight, scale, block)
    m = x.shape[0]
    if not m or not scaled_mm_fits(weight):
        return fp8_gemm_triton(x, weight, scale, block, bias)
    pad = -m % SCALED_MM_ROWS
    if _scaled_mm_layouts.get(_scaled_mm_key(x.device, m + pad, weight, x.dtype, bias), "") is None:
        return fp8_gemm_triton(x, weight, scale, block, bias)  # refused before: the rows as they are
    padded = F.pad(x, (0, 0, 0, pad)) if pad else x
    xq, xs = quantize_rows(padded)
    layout, out = _probe_scaled_mm(xq, xs, weight, scale, bias, x.dtype)
    if out is None and layout is None:
        out = fp8_gemm_triton(padded, weight, scale, block, bias, quantized=(xq, xs))
    elif out is None:
        out = _scaled_mm(xq, xs, weight, scale, bias, x.dtype, layout)
    return out[:m] if pad else out


@torch.library.custom_op("minisgl::fp8_norm_linear", mutates_args=())
def fp8_norm_linear_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_n: int,
    block_k: int,
    group: int,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of h = residual + x (x where residual is None), then the FP8 projection: (y (M, N), h
    (M, K), a copy of x without residual). Up to GEMV_MAX_ROWS rows: the norm writes the e4m3 row and
    its scales (`norm_quantize_rows`), then the GEMV; more: the same kernel writes the normalised rows
    in x's dtype, then `minisgl::fp8_linear`'s choice. norm_weight and residual in x's dtype."""
    block = (block_n, block_k)
    _check_operands(x, weight, scale, block, group)
    if not _gemv_takes(x):
        normed, _, h = _norm_rows(x, residual, norm_weight, eps, quantize=False)
        return fp8_linear_op(normed, weight, scale, bias, block_n, block_k, group), h
    xq, xs, h = norm_quantize_rows(x, residual, norm_weight, eps)
    return fp8_gemv(x, weight, scale, block, bias, quantized=(xq, xs)), h


@fp8_norm_linear_op.register_fake
def _(x, residual, norm_weight, eps, weight, scale, block_n, block_k, group, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape)


@torch.library.custom_op("minisgl::fp8_silu_mul_linear", mutates_args=())
def fp8_silu_mul_linear_op(
    gate_up: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, group: int
) -> torch.Tensor:
    """silu(gate) * up of gate_up (M, 2 K) = [gate | up], then the FP8 projection: (M, N). Up to
    GEMV_MAX_ROWS rows: one kernel writes the product's e4m3 row and scales (`silu_mul_quantize_rows`),
    then the GEMV; more: the same kernel writes the product in x's dtype, then `minisgl::fp8_linear`'s
    choice. (No bias: the MLP's down projection has none.)"""
    block = (block_n, block_k)
    gate = gate_up[:, : gate_up.shape[1] // 2]
    _check_operands(gate, weight, scale, block, group)
    if not _gemv_takes(gate):
        product = _silu_mul_rows(gate_up, quantize=False)[0]
        return fp8_linear_op(product, weight, scale, None, block_n, block_k, group)
    return fp8_gemv(gate, weight, scale, block, quantized=silu_mul_quantize_rows(gate_up))


@fp8_silu_mul_linear_op.register_fake
def _(gate_up, weight, scale, block_n, block_k, group):
    return gate_up.new_empty(gate_up.shape[0], weight.shape[0])


def _gemv_takes(x: torch.Tensor) -> bool:
    """True when the ops run x (M, K) on the GEMV: 1 to GEMV_MAX_ROWS rows (at most GEMV_ROWS_LIMIT), K
    at most MAX_K."""
    return 0 < x.shape[0] <= min(GEMV_MAX_ROWS, GEMV_ROWS_LIMIT) and x.shape[1] <= MAX_K


@torch.library.custom_op("minisgl::fp8_linear", mutates_args=())
def fp8_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    group: int,
    invariant: bool = False,
) -> torch.Tensor:
    """x (M, K) @ W^T (+ bias) -> (M, N) in x's dtype for the FP8 weight (`weight` (N, K) e4m3, `scale`
    (ceil(N / block_n), ceil(K / block_k)) float32; `block_fits`): the GEMV for M <= GEMV_MAX_ROWS,
    else the GEMM of `GEMM_BACKEND` (cuBLAS's for 128x128 blocks only); with `invariant`, the Triton GEMM
    in one configuration at every M."""
    block = (block_n, block_k)
    _check_operands(x, weight, scale, block, group)
    if invariant:
        return fp8_gemm_triton(x, weight, scale, block, bias, config=INVARIANT_CONFIG)
    if _gemv_takes(x):
        return fp8_gemv(x, weight, scale, block, bias)
    if GEMM_BACKEND == "scaled_mm" and block == (GROUP, GROUP):
        return fp8_gemm_scaled_mm(x, weight, scale, bias)
    return fp8_gemm_triton(x, weight, scale, block, bias)


@fp8_linear_op.register_fake
def _(x, weight, scale, bias, block_n, block_k, group, invariant=False):
    return x.new_empty(x.shape[0], weight.shape[0])


def fp8_kernels_fit(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    group: int,
    bias: torch.Tensor | None = None,
) -> bool:
    """True when the op `minisgl::fp8_linear` takes these operands: CUDA, Triton, x bf16/fp16, a
    contiguous e4m3 weight of at most MAX_K columns, a format of `block_fits`, a contiguous float32
    scale, a bias (if any) in x's dtype. Says nothing of x's row count (a compiled graph's batch
    dimension is symbolic)."""
    return (
        triton is not None
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == FP8_DTYPE
        and weight.dim() == 2
        and weight.is_contiguous()
        and 0 < weight.shape[1] <= MAX_K
        and x.shape[-1] == weight.shape[1]
        and block_fits(block, group, weight.shape[1])
        and scale.dtype == torch.float32
        and scale.is_contiguous()
        and (bias is None or bias.dtype == x.dtype)
    )


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (.., K) @ W^T (+ bias) -> (.., N) in x's dtype for an FP8 weight, as the layers run it: the op
    `minisgl::fp8_linear` where `fp8_kernels_fit`, else `minisgl.kernels.fp8.fp8_linear` (the float32
    emulation, the reference: CPU tensors and formats the kernels do not take). Where the engine's GEMV
    kernels are off (`use_gemv_kernel` off or `batch_invariant`) the op runs with `invariant`."""
    if fp8_kernels_fit(x, weight, scale, block, group, bias):
        rows = x.reshape(-1, x.shape[-1])
        y = fp8_linear_op(rows, weight, scale, bias, block[0], block[1], group, not gemv_kernel_mode())
        return y.view(*x.shape[:-1], weight.shape[0])
    return emulated_fp8_linear(x, weight, scale, block, group, bias)
