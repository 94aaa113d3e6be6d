"""gpt-oss (gpt-oss-20b, gpt-oss-120b): a decoder of attention layers with learned sinks, sliding (the
model's `sliding_window`) and full layers by `layer_types`, YaRN rotary embeddings, and a mixture of
experts in every layer with a biased router (top-k of the logits, softmax over those) and experts with
biases and a clamped SwiGLU.

The attention projections, norms and embeddings are Llama's (`minisgl.models.llama`, with q/k/v/o
biases); a layer adds its `sinks` (this rank's heads), the router and the experts in minisgl's MoE
layout (`w13` (E, 2I, H): gate rows, then up rows; `w2` (E, H, I)). The checkpoint's experts come as
transformers writes them (`gate_up_proj` (E, H, 2I) with gate and up interleaved column by column,
`down_proj` (E, I, H)) or as the published MXFP4 tensors (`*_blocks`, `*_scales`: minisgl.models.mxfp4);
both are transposed and de-interleaved at load. Under tensor parallelism every rank holds each expert's
part of I, and rank 0 alone adds the down projection's bias (the outputs are summed over the ranks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minisgl.distributed import all_reduce, divide
from minisgl.layers import apply_rope, linear, norm_linear_keep, rope_cos_sin
from minisgl.layers.attention import sink_attention
from minisgl.models.config import ModelConfig
from minisgl.models.llama import DecoderLayer, LlamaForCausalLM, _param
from minisgl.models.mxfp4 import Mxfp4Weight
from minisgl.models.weights import Shard
from minisgl.moe import moe_biased


class GptOssLayer(DecoderLayer):
    """Llama's attention (biases, no q/k norms) with sinks; the MLP is the router plus the experts."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(dataclasses.replace(cfg, intermediate_size=0))
        num_experts, hidden = cfg.num_experts, cfg.hidden_size
        inter = divide(cfg.moe_intermediate_size, self.tp.size, "intermediate_size")  # local
        self.sinks = _param(self.heads.num_heads)
        self.gate = _param(num_experts, hidden)
        self.router_bias = _param(num_experts)
        self.w13 = _param(num_experts, 2 * inter, hidden)
        self.b13 = _param(num_experts, 2 * inter)
        self.w2 = _param(num_experts, hidden, inter)
        self.b2 = _param(num_experts, hidden)

    def checkpoint_map(self, prefix: str, cfg: ModelConfig) -> dict[str, Any]:
        out: dict[str, Any] = {
            k: v for k, v in super().checkpoint_map(prefix, cfg).items() if ".mlp." not in k
        }
        rank, size = self.tp.rank, self.tp.size
        out[f"{prefix}.self_attn.sinks"] = Shard(self.sinks, 0, rank, size)
        out[f"{prefix}.mlp.router.weight"] = self.gate
        out[f"{prefix}.mlp.router.bias"] = self.router_bias
        experts, inter = f"{prefix}.mlp.experts", self.w2.shape[2]
        num_experts, hidden = self.w13.shape[0], self.w13.shape[2]
        full = inter * size

        def gate_up(dest: torch.Tensor) -> Callable[[int, torch.Tensor], None]:
            def place(e: int, value: torch.Tensor) -> None:  # value: (2I, ...) gate and up interleaved
                ours = slice(rank * inter, (rank + 1) * inter)
                dest[e].copy_(torch.cat([value[0::2][ours], value[1::2][ours]]))

            return place

        def down(e: int, value: torch.Tensor) -> None:  # value: (H, I)
            self.w2[e].copy_(value[:, rank * inter : (rank + 1) * inter])

        def down_bias(e: int, value: torch.Tensor) -> None:  # summed over the ranks: rank 0's alone
            self.b2[e].copy_(value if rank == 0 else torch.zeros_like(value))

        out[f"{experts}.gate_up_proj_bias"] = _Experts((num_experts, 2 * full), gate_up(self.b13))
        out[f"{experts}.down_proj_bias"] = _Experts((num_experts, hidden), down_bias)
        if cfg.mxfp4_experts:
            for name, shape, place in (
                ("gate_up_proj", (num_experts, 2 * full, hidden), gate_up(self.w13)),
                ("down_proj", (num_experts, hidden, full), down),
            ):
                weight = Mxfp4Weight(shape, place)
                out[f"{experts}.{name}_blocks"] = weight.part("blocks")
                out[f"{experts}.{name}_scales"] = weight.part("scales")
        else:  # transformers' layout: (E, in, out)
            out[f"{experts}.gate_up_proj"] = _Experts(
                (num_experts, hidden, 2 * full), gate_up(self.w13), True
            )
            out[f"{experts}.down_proj"] = _Experts((num_experts, full, hidden), down, True)
        return out


@dataclasses.dataclass(frozen=True)
class _Experts:
    """A checkpoint tensor of every expert (`full_shape`), placed an expert at a time (`place(e, its
    tensor)`), transposed first (`transpose`: the checkpoint holds (E, in, out))."""

    full_shape: tuple[int, ...]
    place: Callable[[int, torch.Tensor], None]
    transpose: bool = False

    def load(self, source: Any) -> None:
        tensor = source if isinstance(source, torch.Tensor) else source[:]
        for e in range(self.full_shape[0]):
            self.place(e, tensor[e].transpose(0, 1) if self.transpose else tensor[e])


class GptOssForCausalLM(LlamaForCausalLM):
    """Serves GptOssForCausalLM checkpoints (bf16 / float32 experts, or MXFP4 ones)."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int) -> None:
        super().__init__(dataclasses.replace(cfg, num_layers=0), max_seq_len)
        self.cfg = cfg
        self.layers = nn.ModuleList(GptOssLayer(cfg) for _ in range(cfg.num_layers))
        self._init_kv_scales(cfg.num_layers)

    def _attention(self, layer, layer_id, qkv, rope, fused_rope, lora=None, table=None) -> torch.Tensor:
        """`LlamaForCausalLM._attention`'s arguments; RoPE unfused, then attention with the layer's sinks."""
        cfg, heads = self.cfg, layer.heads
        if fused_rope:  # `rope` holds the positions: the fused kernel does not add sinks
            rope = rope_cos_sin(rope, self.cos_sin if table is None else table, qkv.dtype)
        num_tokens, d = qkv.shape[0], cfg.head_dim
        q, k, v = qkv.split([heads.num_heads * d, heads.num_kv_heads * d, heads.num_kv_heads * d], dim=-1)
        q, k = apply_rope(q.view(num_tokens, -1, d), k.view(num_tokens, -1, d), rope)
        out = sink_attention(q, k, v.reshape(num_tokens, -1, d), layer.sinks, layer_id).reshape(
            num_tokens, -1
        )
        out = all_reduce(self._lora(lora, layer_id, "o_proj", out, linear(out, layer.o_proj)))
        return out if layer.o_bias is None else out + layer.o_bias

    def _mlp(self, layer, layer_id, hidden, residual, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`LlamaForCausalLM._mlp`'s arguments: the post-attention norm, the router (with its bias) and
        the experts; each rank's output a partial sum, all-reduced."""
        cfg = self.cfg
        logits, x, residual = norm_linear_keep(
            hidden, residual, layer.post_norm, cfg.rms_norm_eps, layer.gate
        )
        out = moe_biased(
            x, logits + layer.router_bias, layer.w13, layer.w2, cfg.num_experts_per_tok, layer.b13, layer.b2,
            cfg.swiglu_limit, cfg.swiglu_alpha,
        )  # fmt: skip
        return all_reduce(out), residual
