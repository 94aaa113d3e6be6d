"""`moe`: the sparse MLP as one call into the running engine's MoE backend.

Like `minisgl.layers.attention`, the backend is not held by the model: it is read from the engine's
context (`get_global_ctx().moe_backend`) at call time, and under torch.compile the call goes through
the opaque `minisgl::moe` custom op (with a fake implementation for shapes), so the model's forward
stays one graph with `fullgraph=True` whatever the backend does inside. The Engine sets the backend
(`moe_backend` setting) for models with experts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minisgl.core import get_global_ctx
from minisgl.kernels.moe_gemv import Experts
from minisgl.kernels.packed import PackedWeights
from minisgl.moe.base import BaseMoeBackend


def _backend() -> BaseMoeBackend:
    backend = get_global_ctx().moe_backend
    if backend is None:
        raise RuntimeError("the engine has no MoE backend: it sets one for models with experts")
    return backend


@torch.library.custom_op("minisgl::moe", mutates_args=())
def _moe_op(
    x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int, renormalize: bool
) -> Tensor:
    return _backend().forward(x, router_logits, w13, w2, top_k, renormalize)


@_moe_op.register_fake
def _(x, router_logits, w13, w2, top_k, renormalize):
    return torch.empty_like(x)


@torch.library.custom_op("minisgl::moe_packed", mutates_args=())
def _moe_packed_op(
    x: Tensor, router_logits: Tensor, q13: Tensor, s13: Tensor, z13: Tensor, q2: Tensor, s2: Tensor,
    z2: Tensor, bits: int, top_k: int, renormalize: bool,
) -> Tensor:  # fmt: skip
    w13, w2 = PackedWeights(q13, s13, z13, bits), PackedWeights(q2, s2, z2, bits)
    return _backend().forward(x, router_logits, w13, w2, top_k, renormalize)


@_moe_packed_op.register_fake
def _(x, router_logits, q13, s13, z13, q2, s2, z2, bits, top_k, renormalize):
    return torch.empty_like(x)


def moe(x: Tensor, router_logits: Tensor, w13: Experts, w2: Experts, top_k: int, renormalize: bool) -> Tensor:
    """x (T, H), router_logits (T, E), w13 (E, 2I, H), w2 (E, H, I) -> (T, H); see BaseMoeBackend. The
    experts plain or 4- / 8-bit (`PackedWeights`, both alike)."""
    if not torch.compiler.is_compiling():
        return _backend().forward(x, router_logits, w13, w2, top_k, renormalize)
    if isinstance(w13, PackedWeights):
        return _moe_packed_op(x, router_logits, *w13[:3], *w2[:3], w13.bits, top_k, renormalize)
    return _moe_op(x, router_logits, w13, w2, top_k, renormalize)


@torch.library.custom_op("minisgl::moe_biased", mutates_args=())
def _moe_biased_op(
    x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int, b13: Tensor, b2: Tensor,
    limit: float, alpha: float,
) -> Tensor:  # fmt: skip
    return _backend().forward(
        x, router_logits, w13, w2, top_k, True, b13=b13, b2=b2, limit=limit, alpha=alpha
    )


@_moe_biased_op.register_fake
def _(x, router_logits, w13, w2, top_k, b13, b2, limit, alpha):
    return torch.empty_like(x)


def moe_biased(
    x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int, b13: Tensor, b2: Tensor,
    limit: float, alpha: float,
) -> Tensor:  # fmt: skip
    """gpt-oss's sparse MLP: as `moe` (the top-k weights renormalised) with the experts' biases b13
    (E, 2I) and b2 (E, H) and the SwiGLU clamped at `limit` (`minisgl.moe.torch_backend.swiglu`)."""
    if torch.compiler.is_compiling():
        return _moe_biased_op(x, router_logits, w13, w2, top_k, b13, b2, limit, alpha)
    return _backend().forward(
        x, router_logits, w13, w2, top_k, True, b13=b13, b2=b2, limit=limit, alpha=alpha
    )
