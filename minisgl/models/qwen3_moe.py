"""Qwen3-MoE (Qwen3-30B-A3B and kin): the Qwen3 decoder with a mixture-of-experts MLP.

Everything but the MLP of sparse layers is Qwen3's and is inherited from `minisgl.models.llama`. A
sparse layer holds a router `gate` (E, H) and the experts fused into two tensors: `w13` (E, 2I, H),
each expert's gate projection in rows [0, I) and up projection in rows [I, 2I), and `w2` (E, H, I),
its down projection. Which layers are sparse is `ModelConfig.is_sparse_layer` (transformers' rule).

The MoE computation itself is `minisgl.moe.moe`, which calls the backend of the running engine's
context, as attention does: the model holds weights only, and the forward stays one graph under
torch.compile(fullgraph=True) (see `minisgl.moe.op`).

Single GPU only for now: no tensor or expert parallelism (the forward all-reduces nothing).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from minisgl.layers import add_rms_norm, embed, linear, lm_head, mlp, rms_norm, rope_cos_sin
from minisgl.models.config import ModelConfig
from minisgl.models.llama import DecoderLayer, LlamaForCausalLM, _param
from minisgl.moe import moe


class SparseDecoderLayer(DecoderLayer):
    """Qwen3's attention and norms; the MLP is a router plus fused experts. The parent's dense MLP
    weights are built with zero rows (so its attention code and checkpoint map are reused unchanged)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(dataclasses.replace(cfg, intermediate_size=0))
        num_experts, inter, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate = _param(num_experts, hidden)
        self.w13 = _param(num_experts, 2 * inter, hidden)
        self.w2 = _param(num_experts, hidden, inter)

    def checkpoint_map(self, prefix: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
        out = {k: v for k, v in super().checkpoint_map(prefix, cfg).items() if ".mlp." not in k}
        out[f"{prefix}.mlp.gate.weight"] = self.gate
        inter = cfg.moe_intermediate_size
        for e in range(cfg.num_experts):
            experts = f"{prefix}.mlp.experts.{e}"
            out[f"{experts}.gate_proj.weight"] = self.w13[e, :inter]
            out[f"{experts}.up_proj.weight"] = self.w13[e, inter:]
            out[f"{experts}.down_proj.weight"] = self.w2[e]
        return out


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Serves Qwen3MoeForCausalLM checkpoints (per-expert tensor names, as on the hub and as
    transformers' save_pretrained writes them)."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int) -> None:
        # the parent builds the embedding, final norm, lm_head and RoPE cache; the layers are built here
        super().__init__(dataclasses.replace(cfg, num_layers=0), max_seq_len)
        self.cfg = cfg
        self.layers = nn.ModuleList(
            SparseDecoderLayer(cfg) if cfg.is_sparse_layer(i) else DecoderLayer(cfg)
            for i in range(cfg.num_layers)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, last_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """As LlamaForCausalLM.forward, with the sparse layers' MLP replaced by the MoE."""
        cfg = self.cfg
        hidden = embed(input_ids, self.embed_tokens)
        cos_sin = rope_cos_sin(positions, self.cos_sin, hidden.dtype)
        residual = hidden
        for layer_id, layer in enumerate(self.layers):
            if layer_id == 0:
                x = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            else:
                x, residual = add_rms_norm(hidden, residual, layer.input_norm, cfg.rms_norm_eps)
            hidden = self._attention(layer, layer_id, x, cos_sin)
            x, residual = add_rms_norm(hidden, residual, layer.post_norm, cfg.rms_norm_eps)
            if isinstance(layer, SparseDecoderLayer):
                router_logits = linear(x, layer.gate)
                hidden = moe(
                    x, router_logits, layer.w13, layer.w2, cfg.num_experts_per_tok, cfg.norm_topk_prob
                )
            else:
                hidden = mlp(x, layer.gate_up_proj, layer.down_proj)
        hidden = residual + hidden
        if last_indices is not None:
            hidden = hidden[last_indices]
        hidden = rms_norm(hidden, self.norm, cfg.rms_norm_eps)
        return lm_head(hidden, self.embed_tokens if self.lm_head is None else self.lm_head)
