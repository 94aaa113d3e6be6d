"""Attention as one opaque op: the KV store and the attention kernel of the current backend.

Under torch.compile it is the `minisgl::attention` custom op (one opaque node, `fullgraph=True` holds);
in eager mode the backend is called directly. `rope_attention` starts from the QKV projection's output
(the fused kernel of `minisgl.kernels.rope_store`; the op `minisgl::rope_attention`, in eager mode
too). docs/gpu.md.
"""

from __future__ import annotations

import torch

from minisgl.core import get_global_ctx
from minisgl.kernels.rope_store import qk_norm_rope_store


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


@torch.library.custom_op("minisgl::rope_attention", mutates_args=())
def rope_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    layer_id: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Attention from the QKV projection's output (T, (num_heads + 2 num_kv_heads) head_dim): the q/k
    norms (Qwen3's, when given), RoPE at `positions` (cos and sin from the float32 table `cos_sin`) and the
    KV store run as one fused kernel (`qk_norm_rope_store`), then the backend attends. (T, H, D) out.
    One custom op in eager mode too (it only runs where the Triton kernel does)."""
    ctx = get_global_ctx()
    batch = ctx.batch
    k_cache, v_cache = ctx.kv_cache.flat(layer_id)
    q = qk_norm_rope_store(
        qkv, positions, cos_sin, q_norm, k_norm, eps, batch.out_loc, k_cache, v_cache, num_heads,
        num_kv_heads, head_dim, ctx.kv_cache.layer_scales(layer_id),
    )  # fmt: skip
    return ctx.attn_backend.attend(q, layer_id, batch).contiguous()


@rope_attention.register_fake
def _(qkv, positions, cos_sin, q_norm, k_norm, eps, layer_id, num_heads, num_kv_heads, head_dim):
    return qkv.new_empty(qkv.shape[0], num_heads, head_dim)


@torch.library.custom_op("minisgl::sink_attention", mutates_args=())
def _sink_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, layer_id: int
) -> torch.Tensor:
    ctx = get_global_ctx()
    return ctx.attn_backend.forward_sinks(q, k, v, sinks, layer_id, ctx.batch).contiguous()


@_sink_attention_op.register_fake
def _(q, k, v, sinks, layer_id):
    return q.new_empty(q.shape)


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, layer_id: int
) -> torch.Tensor:
    """`attention` with learned attention sinks (gpt-oss): `sinks` (H,) float32, a logit per query head
    that joins the softmax's denominator (a key whose value is zero)."""
    if torch.compiler.is_compiling():
        return _sink_attention_op(q, k, v, sinks, layer_id)
    ctx = get_global_ctx()
    return ctx.attn_backend.forward_sinks(q, k, v, sinks, layer_id, ctx.batch)
