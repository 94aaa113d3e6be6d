"""The reference MoE backend in plain torch, on CPU and GPU, numerically matching transformers."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from minisgl.kernels.moe_gemv import Experts
from minisgl.kernels.packed import PackedWeights
from minisgl.moe.base import BaseMoeBackend


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, top_k) in `dtype`, expert ids (T, top_k)): softmax in float32, top-k, optional
    renormalisation in float32, then the cast, as transformers' Qwen3MoeTopKRouter does."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def swiglu(h: Tensor, limit: float | None = None, alpha: float = 1.702) -> Tensor:
    """SiLU(gate) * up of h = [gate | up] (T, 2I); with `limit`, gpt-oss's clamped variant: the gate
    clamped above at `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = h.chunk(2, dim=-1)
    if limit is None:
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def torch_moe(
    x: Tensor, router_logits: Tensor, w13: Experts, w2: Experts, top_k: int, renormalize: bool, **biased: Any
) -> Tensor:
    """The reference MoE (see `TorchMoeBackend`); shapes as in `BaseMoeBackend.forward`. gpt-oss's
    experts (`biased`) add biases b13 (E, 2I) and b2 (E, H) and take `swiglu`'s clamped variant
    (`limit`, `alpha`). Packed experts (`PackedWeights`) are dequantized for the call."""
    if isinstance(w13, PackedWeights):
        w13, w2 = w13.dequantize(x.dtype), w2.dequantize(x.dtype)
    b13, b2 = biased.get("b13"), biased.get("b2")
    limit, alpha = biased.get("limit"), biased.get("alpha", 1.702)
    weights, ids = select_experts(router_logits, top_k, renormalize, x.dtype)
    out = torch.zeros_like(x)
    flat_ids = ids.flatten()  # (T * top_k,): token t's slot j is row t * top_k + j
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    tokens = order // top_k
    slot_weights = weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        start += count
        h = F.linear(x[tokens[rows]], w13[expert], None if b13 is None else b13[expert])
        act = swiglu(h, limit, alpha)
        y = F.linear(act, w2[expert], None if b2 is None else b2[expert]) * slot_weights[rows, None]
        out.index_add_(0, tokens[rows], y)
    return out


class TorchMoeBackend(BaseMoeBackend):
    """Loops over the experts that received tokens: gathers their tokens, runs SwiGLU and the down
    projection, scales by the routing weight and adds into the output in expert order (the order, and
    the dtypes, of transformers' Qwen3MoeExperts).

    The token count of each expert is data-dependent, so this backend is for eager execution (CPU, and
    GPU without CUDA graphs); a graph-capturable GPU backend is the job of the 'fused' one.
    """

    forward = staticmethod(torch_moe)
