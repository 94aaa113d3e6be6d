"""Attention as one opaque op: the KV store and the attention kernel of the current backend.

Under torch.compile the call goes through the `minisgl::attention` custom op, so the compiler sees
one opaque node (with a fake implementation for shapes) and `fullgraph=True` holds; the op reads the
running batch from the engine's context. In eager mode the backend is called directly.
"""

from __future__ import annotations

import torch

from minisgl.core import get_global_ctx


@torch.library.custom_op("minisgl::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    ctx = get_global_ctx()
    return ctx.attn_backend.forward(q, k, v, layer_id, ctx.batch).contiguous()


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    return q.new_empty(q.shape)  # contiguous, whatever the layout the compiler gave q


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    """Stores k and v at the batch's `out_loc`, then attends. q: (T, H, D), k and v: (T, KVH, D)."""
    if torch.compiler.is_compiling():
        return _attention_op(q, k, v, layer_id)
    ctx = get_global_ctx()
    return ctx.attn_backend.forward(q, k, v, layer_id, ctx.batch)
