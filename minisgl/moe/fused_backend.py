"""The fused MoE backend: route (`select_experts`), sort the (token, slot) pairs by expert, two grouped
GEMMs (gate/up with SiLU-and-multiply, down scaled by the routing weights), combine. On CUDA the GEMMs
are Triton's (`minisgl.kernels.moe_gemm`) and a few tokens take `minisgl.kernels.moe_gemv`; on CPU
(and as `grouped_moe`) `torch._grouped_mm`. No shape depends on the routing, so it is captured in CUDA
graphs. docs/tensor-parallel-and-moe.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from minisgl.kernels.linear import gemv_rows
from minisgl.kernels.moe_gemm import moe_gemm
from minisgl.kernels.moe_gemv import Experts, moe_gemv, moe_gemv_fits
from minisgl.kernels.packed import PackedWeights
from minisgl.moe.base import BaseMoeBackend
from minisgl.moe.torch_backend import select_experts, swiglu


def fused_unsupported_reason(device: torch.device | str) -> str | None:
    """Why the fused backend cannot run (capturable) on `device`, or None when it can: on CUDA,
    torch._grouped_mm has its sync-free kernel on sm90 and sm100 only (H100/H200, B200/B300)."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"device {device} is neither CPU nor CUDA"
    if torch.version.hip:
        return "on ROCm torch._grouped_mm runs its per-group fallback, which syncs with the host"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return (
            f"the GPU is sm_{major}{minor}: torch._grouped_mm's kernel is built for sm90/sm100 only, "
            "elsewhere it runs a per-group fallback that syncs with the host"
        )
    return None


def check_fused_moe_shapes(x: torch.Tensor, w13: Experts, w2: Experts, top_k: int) -> None:
    """Raises ValueError, naming the value, for inputs the grouped GEMMs cannot take.

    `torch._grouped_mm` needs every operand's leading stride (H for the token rows and w13, I for the
    activations and w2) to be a multiple of 16 bytes, int32 offsets, and one dtype throughout. Packed
    experts (`PackedWeights`) are checked for their shapes and x's dtype."""
    packed = isinstance(w13, PackedWeights)
    if x.dim() != 2:
        raise ValueError(f"fused MoE: x must be 2D (tokens, hidden), got x.shape={tuple(x.shape)}")
    if len(w13.shape) != 3 or len(w2.shape) != 3:
        raise ValueError(
            f"fused MoE: w13 and w2 must be 3D, got w13.shape={tuple(w13.shape)}, w2.shape={tuple(w2.shape)}"
        )
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if two_inter % 2 or x.shape[1] != hidden or tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(
            "fused MoE: expected x (T, H), w13 (E, 2I, H), w2 (E, H, I); got "
            f"x.shape={tuple(x.shape)}, w13.shape={tuple(w13.shape)}, w2.shape={tuple(w2.shape)}"
        )
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"fused MoE: top_k={top_k} must be in [1, num_experts={num_experts}]")
    if not packed and not x.dtype == w13.dtype == w2.dtype:
        raise ValueError(
            f"fused MoE: x, w13 and w2 must share one dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}"
        )
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        raise ValueError(
            f"moe_backend='fused' on CUDA needs bfloat16 (torch._grouped_mm's kernel), got dtype={x.dtype}: "
            "run in bfloat16 or use moe_backend='torch'"
        )
    size = x.element_size()
    for name, value in (("hidden_size", hidden), ("moe_intermediate_size (per rank)", inter)):
        if value * size % 16:
            raise ValueError(
                f"fused MoE: {name}={value} is not a multiple of {16 // size} ({x.dtype}): "
                "torch._grouped_mm needs rows of a multiple of 16 bytes; use moe_backend='torch'"
            )
    for name, w in () if packed else (("w13", w13), ("w2", w2)):
        if w.stride(-1) != 1 or w.stride(-2) != w.shape[-1]:
            raise ValueError(
                f"fused MoE: {name} must be contiguous in its last two dims, got {name}.stride()={w.stride()}"
            )


def fused_moe(
    x: Tensor, router_logits: Tensor, w13: Experts, w2: Experts, top_k: int, renormalize: bool, **biased
) -> Tensor:
    """The fused MoE as a function (see the module docstring); shapes as in `BaseMoeBackend.forward`.
    `biased` (gpt-oss: b13, b2, limit, alpha; see `torch_moe`) takes the grouped GEMMs always. Packed
    experts (`PackedWeights`) run packed on the Triton kernels, dequantized for the call elsewhere."""
    check_fused_moe_shapes(x, w13, w2, top_k)
    if biased:
        return grouped_moe(x, router_logits, w13, w2, top_k, renormalize, **biased)
    if x.is_cuda and x.shape[0] > 0 and moe_gemv_fits(x, w13, w2):
        if x.shape[0] <= gemv_rows(w13):
            return moe_gemv(x, router_logits, w13, w2, top_k, renormalize)
        weights, ids = select_experts(router_logits, top_k, renormalize, x.dtype)
        return moe_gemm(x, weights, ids, w13, w2)
    if isinstance(w13, PackedWeights):  # the reference
        w13, w2 = w13.dequantize(x.dtype), w2.dequantize(x.dtype)
    return grouped_moe(x, router_logits, w13, w2, top_k, renormalize)


def grouped_moe(
    x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int, renormalize: bool, **biased: Any
) -> Tensor:
    """The grouped GEMM path of `fused_moe` at any token count (its shapes checked by the caller);
    gpt-oss's biases and clamped SwiGLU (`biased`) as in `torch_moe`."""
    b13, b2 = biased.get("b13"), biased.get("b2")
    num_tokens, hidden = x.shape
    num_experts = w2.shape[0]
    if num_tokens == 0:
        return torch.empty_like(x)
    weights, ids = select_experts(router_logits, top_k, renormalize, x.dtype)

    # sort the (token, slot) pairs by expert; pair p = t * top_k + j is token t's slot j
    flat_ids = ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offs = counts.cumsum(0).to(torch.int32)  # end row of each expert's group
    rows = x.index_select(0, order // top_k)  # (T * top_k, H), contiguous, grouped by expert

    # The weights go in as transposed views: w13 (E, 2I, H) -> (E, H, 2I) and w2 (E, H, I) -> (E, I, H)
    # have stride 1 along their second-to-last dim, i.e. column-major last two dims, the layout that
    # CUTLASS's sm90 grouped GEMM reads natively for mat_b (`out = x @ W.T`, as F.linear); no copy.
    # torch._grouped_mm also accepts row-major mat_b; on CPU both run as per-expert `mm`.
    h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)  # (T * top_k, 2I)
    row_experts = flat_ids.index_select(0, order) if b13 is not None or b2 is not None else None
    if b13 is not None:
        h = h + b13.index_select(0, row_experts)
    act = swiglu(h, biased.get("limit"), biased.get("alpha", 1.702))  # (T * top_k, I), contiguous
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # (T * top_k, H)
    if b2 is not None:
        y = y + b2.index_select(0, row_experts)

    # bf16 * bf16 is computed in float32 and rounded once, the same as weighting in float32 then casting
    y = y * weights.flatten().index_select(0, order)[:, None]
    # back to pair order: order is a permutation, so the copy has no colliding writes
    y = torch.empty_like(y).index_copy_(0, order, y)
    # the sum over the top_k slots accumulates in float32 (for bf16 too) and rounds once
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


class FusedMoeBackend(BaseMoeBackend):
    """Grouped GEMMs over the tokens sorted by expert (see `minisgl.moe.fused_backend`): no host sync,
    so it runs inside captured CUDA graphs; bfloat16 on CUDA (sm90+), any float dtype on CPU."""

    graph_capturable = True
    forward = staticmethod(fused_moe)
