"""The model's projections as custom ops that pick their kernels by row count when they run, so the
engine compiles the forward once for every batch size: few rows run the GEMV kernels of
`minisgl.kernels.gemv` (prologues fused), more run a Triton row kernel and cuBLAS.

    torch.ops.minisgl.linear(x, weight, bias)                           -> y
    torch.ops.minisgl.norm_linear(x, residual, norm_weight, weight, bias, eps, keep_normed=False)
                                                   -> (y, new residual, normed rows or an empty tensor)
    torch.ops.minisgl.silu_mul_linear(gate_up, weight)                  -> y

Rows per shape (`GEMV_ROWS_BY_SHAPE`), when `minisgl.layers.basic` uses them and their numerics:
docs/gpu.md ("One-row GEMV", "Numerics"). On a CPU the kernels run under Triton's interpreter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.kernels.gemv import add_rms_norm_gemv, gemv, silu_mul_gemv
from minisgl.kernels.packed import PackedWeights

# the most rows (tokens) sent to a few-row kernel rather than a GEMM, by weight shape: (N, K) for a
# projection, on the GEMV kernel (at most `minisgl.kernels.gemv.GEMV_MAX_ROWS`); (E, 2I, H) for the
# experts' w13 of a MoE layer, on `minisgl.kernels.moe_gemv`. Set where the kernel beat the GEMM path on an
# H200: Qwen3-0.6B's projections against add_rms_norm_rows / silu_mul_rows + cuBLAS (QKV to 2 rows: 6.2
# vs 6.9 us; O to 4: 4.0-4.7 vs 8.4-13.1; down to 4: 5.7-7.5 vs 8.8-9.0; gate/up and the LM head lost at
# 2 rows already); Qwen3-30B-A3B's experts against the grouped GEMMs (`python -m perf.gpu.moe`)
GEMV_ROWS_BY_SHAPE: dict[tuple[int, ...], int] = {
    (4096, 1024): 2,
    (1024, 2048): 4,
    (1024, 3072): 4,
    (128, 1536, 2048): 8,
}
# every other projection
LINEAR_GEMV_ROWS = 1
# every other MoE layer: the experts' kernels read each chosen expert once, the grouped GEMMs' sort,
# gather and scatter cost more than that up to a few tokens whatever the shape
MOE_GEMV_TOKENS = 4


def gemv_rows(weight: torch.Tensor | PackedWeights) -> int:
    """The most rows of x the ops multiply by `weight` on the GEMV kernel (`weight` (N, K)), or the
    most tokens a MoE layer runs on its few-token kernels (`weight` the experts' w13, (E, 2I, H); packed
    experts by their own key, (E, 2I, H, bits))."""
    shape = tuple(weight.shape)
    default = LINEAR_GEMV_ROWS if len(shape) == 2 else MOE_GEMV_TOKENS
    return GEMV_ROWS_BY_SHAPE.get(
        (*shape, weight.bits) if isinstance(weight, PackedWeights) else shape, default
    )


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the layers never call these ops
    triton = None


def _row_warps(width: int) -> int:
    return 4 if width <= 4096 else 8 if width <= 8192 else 16


if triton is not None:

    @triton.jit
    def _add_rms_norm_rows_kernel(
        x_ptr,
        residual_ptr,
        norm_ptr,
        out_ptr,
        residual_out_ptr,
        x_row_stride,
        residual_row_stride,
        eps,
        K: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < K
        dtype = out_ptr.dtype.element_ty
        h = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
            h = h + r.to(tl.float32)  # stored rounded; the norm reads the float32 sum
        tl.store(residual_out_ptr + row * K + cols, h.to(dtype), mask=mask)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / K + eps)
        w = tl.load(norm_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # normalised and scaled in float32, rounded once, as inductor's kernel of the unfused layers on a
        # GPU does (the GEMV prologue does not round at all): each rounding before added error
        y = (h * rstd * w).to(dtype)
        tl.store(out_ptr + row * K + cols, y, mask=mask)

    @triton.jit
    def _silu_mul_rows_kernel(gate_up_ptr, out_ptr, row_stride, K, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < K
        src = gate_up_ptr + row * row_stride
        gate = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(src + K + cols, mask=mask, other=0.0).to(tl.float32)
        y = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + row * K + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_rows(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` (x + residual, then RMSNorm) of every row of x (T, K), one program per row.
    Returns (normalised, new residual), both new (T, K) tensors; without a residual the new residual is
    a copy of x (as `add_rms_norm_gemv` returns one)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    rows, k = x.shape
    out, residual_out = x.new_empty(rows, k), x.new_empty(rows, k)
    if rows:
        _add_rms_norm_rows_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            norm_weight,
            out,
            residual_out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            eps,
            K=k,
            BLOCK=triton.next_power_of_2(k),
            HAS_RESIDUAL=residual is not None,
            num_warps=_row_warps(k),
        )
    return out, residual_out


def silu_mul_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of every row of gate_up (T, 2 K) = [gate | up] -> (T, K), in float32, rounded once."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, k = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, k)
    if rows:
        block = min(1024, triton.next_power_of_2(k))
        _silu_mul_rows_kernel[(rows, triton.cdiv(k, block))](gate_up, out, gate_up.stride(0), k, BLOCK=block)
    return out


@torch.library.custom_op("minisgl::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, K) @ weight (N, K)^T (+ bias) -> (T, N): the GEMV kernel for one row, cuBLAS for more."""
    if 1 <= x.shape[0] <= gemv_rows(weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


@linear_op.register_fake
def _(x, weight, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("minisgl::norm_linear", mutates_args=())
def norm_linear_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    keep_normed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm of h = x + residual (x when residual is None), then the projection: (y (T, N), h (T, K),
    normed). One row: one kernel (`add_rms_norm_gemv`); more: `add_rms_norm_rows`, then cuBLAS.
    `keep_normed`: normed is the normalised rows (T, K), for a second consumer of the norm (a MoE layer's
    experts beside its router; with one row the kernel's first program writes it after its sweep, in
    place of inductor's three kernels of the unfused norm); else an empty (0,) tensor."""
    if 1 <= x.shape[0] <= gemv_rows(weight):
        # (y, normed, h) when kept, else (y, h)
        y, *kept, h = add_rms_norm_gemv(x, residual, norm_weight, weight, bias, eps, keep_normed)
    else:
        normed, h = add_rms_norm_rows(x, residual, norm_weight, eps)
        y, kept = F.linear(normed, weight, bias), [normed]
    return y, h, kept[0] if keep_normed else x.new_empty(0)


@norm_linear_op.register_fake
def _(x, residual, norm_weight, weight, bias, eps, keep_normed=False):
    normed = x.new_empty(x.shape) if keep_normed else x.new_empty(0)
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape), normed


@torch.library.custom_op("minisgl::silu_mul_linear", mutates_args=())
def silu_mul_linear_op(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up (T, 2 K) = [gate | up], then the projection: (T, N). One row: one
    kernel (`silu_mul_gemv`); more: `silu_mul_rows`, then cuBLAS."""
    if 1 <= gate_up.shape[0] <= gemv_rows(weight):
        return silu_mul_gemv(gate_up, weight)
    return F.linear(silu_mul_rows(gate_up), weight)


@silu_mul_linear_op.register_fake
def _(gate_up, weight):
    return gate_up.new_empty(gate_up.shape[0], weight.shape[0])
