"""Norms, projections, the gated MLP and the embedding, as plain functions.

Under tensor parallelism `embed` and `lm_head` are vocab-parallel: each rank holds a contiguous slice of
P = ceil(V / tp) rows of the vocabulary (rank r: rows [r * P, (r + 1) * P), zero-padded past V) and they
communicate themselves. Column- and
row-parallel projections need no special function: the caller all-reduces a row-parallel output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.compile import fused_kernels_mode, gemv_kernel_mode
from minisgl.distributed import all_gather, all_reduce, get_tp_info
from minisgl.kernels import fp8_gemm
from minisgl.kernels.fp8_gemm import (
    fp8_kernels_fit,
    fp8_linear,
    fp8_norm_linear_op,
    fp8_silu_mul_linear_op,
)
from minisgl.kernels.gemv import gemv_fits
from minisgl.kernels.linear import linear_op, norm_linear_op, silu_mul_linear_op
from minisgl.kernels.packed_gemm import packed_linear
from minisgl.layers.fp8 import Fp8Linear
from minisgl.layers.packed import PackedLinear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back to x's dtype, then scaled by weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adds x to the residual stream, then normalises it. Returns (normalised, new residual)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def linear(
    x: torch.Tensor, weight: torch.Tensor | Fp8Linear, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight^T (+ bias). An FP8 weight (`Fp8Linear`) runs `minisgl.kernels.fp8_gemm.fp8_linear` (the
    FP8 kernels on CUDA, the float32 emulation elsewhere); a 4- or 8-bit one (`PackedLinear`)
    `minisgl.kernels.packed_gemm.packed_linear`. Half precision on CUDA goes
    through the op `minisgl::linear`, which runs a single row on the Triton GEMV kernel and more on
    cuBLAS (not in an engine with ``use_gemv_kernel`` off, nor with ``batch_invariant``: a row alone must
    get the bits it gets inside a batch; those run `F.linear`)."""
    if isinstance(weight, Fp8Linear):
        return fp8_linear(x, weight.weight, weight.scale, weight.block, weight.group, bias)
    if isinstance(weight, PackedLinear):
        w = weight
        return packed_linear(x, w.qweight, w.scales, w.zeros, w.perm, bias, w.bits)
    if gemv_fits(x, weight) and gemv_kernel_mode():
        return linear_op(x, weight, bias)
    return F.linear(x, weight, bias)


def _fused_gemv(x: torch.Tensor, weight: torch.Tensor | Fp8Linear) -> bool:
    if not isinstance(weight, torch.Tensor):  # the fused GEMV kernels take half-precision weights only
        return False
    return gemv_fits(x, weight) and gemv_kernel_mode() and fused_kernels_mode()


def _fused_fp8(x: torch.Tensor, weight: torch.Tensor | Fp8Linear, *others: torch.Tensor | None) -> bool:
    """True where an FP8 weight's norm or SiLU-and-multiply quantizes its output itself (the ops
    `minisgl::fp8_norm_linear`, `minisgl::fp8_silu_mul_linear`): the FP8 kernels take x (2-D) and the
    weight (`fp8_kernels_fit`), the engine's GEMV and fused kernels are on, and `others` (the norm
    weight, the residual, the bias) are in x's dtype; only with `fp8_gemm.FUSED_QUANTIZE` on."""
    return (
        fp8_gemm.FUSED_QUANTIZE
        and isinstance(weight, Fp8Linear)
        and x.dim() == 2
        and gemv_kernel_mode()
        and fused_kernels_mode()
        and fp8_kernels_fit(x, weight.weight, weight.scale, weight.block, weight.group)
        and all(t is None or t.dtype == x.dtype for t in others)
    )


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor | Fp8Linear,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x + residual (of x alone when residual is None), then `linear`. Returns (output, new
    residual). On the GEMV kernel's path with the engine's ``use_fused_kernels`` on, the op
    `minisgl::norm_linear` runs one row as one kernel and more as a Triton add + RMSNorm and cuBLAS; an
    FP8 weight there runs `minisgl::fp8_norm_linear` (up to 2 rows the norm writes the e4m3 row)."""
    if _fused_gemv(x, weight):
        y, residual, _ = norm_linear_op(x, residual, norm_weight, weight, bias, eps)
        return y, residual
    if _fused_fp8(x, weight, norm_weight, residual, bias):
        w = weight  # an Fp8Linear
        return fp8_norm_linear_op(x, residual, norm_weight, eps, w.weight, w.scale, *w.block, w.group, bias)
    if residual is None:
        normed, residual = rms_norm(x, norm_weight, eps), x
    else:
        normed, residual = add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias), residual


def norm_linear_keep(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor | Fp8Linear,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`norm_linear` that also returns the normalised rows: (output, normalised, new residual), for a
    norm with a second consumer (a MoE layer's router and its experts). On the GEMV kernel's path with
    ``use_fused_kernels`` on, the op `minisgl::norm_linear` keeping them: one row is one kernel."""
    if _fused_gemv(x, weight):
        y, residual, normed = norm_linear_op(x, residual, norm_weight, weight, None, eps, keep_normed=True)
        return y, normed, residual
    normed, residual = add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight), normed, residual


def silu_mul_linear(
    gate_up: torch.Tensor, w_down: torch.Tensor | Fp8Linear, act: str = "silu"
) -> torch.Tensor:
    """The second half of the SwiGLU MLP, whose gate and up projections are one weight of 2 *
    intermediate rows: gate_up = [gate | up] on the last dimension -> `linear(silu(gate) * up, w_down)`;
    `act` "gelu_tanh": GeGLU (Gemma), `gelu(gate, approximate="tanh") * up`, unfused.
    On the GEMV kernel's path with ``use_fused_kernels`` on, the op `minisgl::silu_mul_linear` runs one
    row as one kernel and more as a Triton SiLU-and-multiply and cuBLAS; an FP8 weight there runs
    `minisgl::fp8_silu_mul_linear` (up to 2 rows one kernel writes the product's e4m3 row)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if act != "silu":
        return linear(F.gelu(gate, approximate="tanh") * up, w_down)
    if _fused_gemv(gate, w_down):
        return silu_mul_linear_op(gate_up, w_down)
    if _fused_fp8(gate, w_down):
        return fp8_silu_mul_linear_op(gate_up, w_down.weight, w_down.scale, *w_down.block, w_down.group)
    return linear(F.silu(gate) * up, w_down)


def embed(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Embedding rows of `input_ids`. Vocab-parallel: ids outside this rank's slice give zeros, and the
    sum over ranks gives every rank the full embedding."""
    tp = get_tp_info()
    if tp.size == 1:
        return F.embedding(input_ids, weight)
    local_ids = input_ids - tp.rank * weight.shape[0]
    inside = (local_ids >= 0) & (local_ids < weight.shape[0])
    out = F.embedding(local_ids.masked_fill(~inside, 0), weight)
    return all_reduce(out * inside.unsqueeze(-1).to(out.dtype))


# the most rows of a CPU forward's logits that `lm_head` computes as weight @ hidden^T
CPU_HEAD_ROWS = 16


def lm_head(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits (.., vocab_size) in float32 (sampling and comparisons want full precision). Vocab-parallel:
    each rank's logits over its slice, gathered so that every rank holds (and samples from) the full
    vocabulary; the padding rows of a vocabulary the ranks do not divide are cut off."""
    eager_cpu = hidden.device.type == "cpu" and not torch.compiler.is_compiling()
    if eager_cpu and hidden.dim() == 2 and hidden.shape[0] <= CPU_HEAD_ROWS:
        # weight @ hidden^T: the CPU GEMM library's path for a few rows against a vocabulary-wide matrix
        # takes 1.5x to 2x the time of the product with the operands swapped (SmolLM2's 49,152 x 576 at
        # 1 to 16 rows, float32, one thread; docs/testing.md#the-cpu-forward)
        out = torch.mm(weight, hidden.t()).t().contiguous()
    else:
        out = linear(hidden, weight)
    logits = all_gather(out.float(), dim=-1)
    return logits if logits.shape[-1] == vocab_size else logits[..., :vocab_size]
