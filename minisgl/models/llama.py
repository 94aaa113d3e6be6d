"""Llama-style dense decoders: Llama (2, 3.x, SmolLM2), Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

The module only holds weights; `forward` composes the pure functions of `minisgl.layers`. Q, K and V
are one merged projection, and so are the MLP's gate and up projections: fewer, larger GEMMs.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.layers import (
    add_rms_norm,
    apply_rope,
    attention,
    build_rope_cache,
    embed,
    linear,
    lm_head,
    mlp,
    rms_norm,
    rope_cos_sin,
)
from minisgl.models.config import ModelConfig


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden, head_dim = cfg.hidden_size, cfg.head_dim
        q_size, kv_size = cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim
        self.input_norm = _param(hidden)
        self.qkv_proj = _param(q_size + 2 * kv_size, hidden)
        self.qkv_bias = _param(q_size + 2 * kv_size) if cfg.qkv_bias else None
        self.q_norm = _param(head_dim) if cfg.qk_norm else None
        self.k_norm = _param(head_dim) if cfg.qk_norm else None
        self.o_proj = _param(hidden, q_size)
        self.o_bias = _param(hidden) if cfg.o_bias else None
        self.post_norm = _param(hidden)
        self.gate_up_proj = _param(2 * cfg.intermediate_size, hidden)
        self.down_proj = _param(hidden, cfg.intermediate_size)

    def checkpoint_map(self, prefix: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv_rows = {
            "q": slice(0, q_size),
            "k": slice(q_size, q_size + kv_size),
            "v": slice(q_size + kv_size, None),
        }
        inter = cfg.intermediate_size
        out = {
            f"{prefix}.input_layernorm.weight": self.input_norm,
            f"{prefix}.post_attention_layernorm.weight": self.post_norm,
            f"{prefix}.self_attn.o_proj.weight": self.o_proj,
            f"{prefix}.mlp.gate_proj.weight": self.gate_up_proj[:inter],
            f"{prefix}.mlp.up_proj.weight": self.gate_up_proj[inter:],
            f"{prefix}.mlp.down_proj.weight": self.down_proj,
        }
        for name, rows in qkv_rows.items():
            out[f"{prefix}.self_attn.{name}_proj.weight"] = self.qkv_proj[rows]
            if self.qkv_bias is not None:
                out[f"{prefix}.self_attn.{name}_proj.bias"] = self.qkv_bias[rows]
        if self.o_bias is not None:
            out[f"{prefix}.self_attn.o_proj.bias"] = self.o_bias
        if self.q_norm is not None:
            out[f"{prefix}.self_attn.q_norm.weight"] = self.q_norm
            out[f"{prefix}.self_attn.k_norm.weight"] = self.k_norm
        return out


class LlamaForCausalLM(nn.Module):
    """Serves LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM checkpoints."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        self.register_buffer(
            "cos_sin",
            build_rope_cache(cfg.head_dim, max_seq_len, cfg.rope, self.embed_tokens.device),
            persistent=False,
        )

    def checkpoint_map(self) -> dict[str, torch.Tensor]:
        out = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if self.lm_head is not None:
            out["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            out.update(layer.checkpoint_map(f"model.layers.{i}", self.cfg))
        return out

    def checkpoint_ignored(self) -> frozenset[str]:
        # tied checkpoints sometimes still store a copy of the embedding as lm_head
        return frozenset({"lm_head.weight"}) if self.lm_head is None else frozenset()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, last_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Tokens (T,) at positions (T,) -> float32 logits of each request's last token (or of every row
        when `last_indices` is None)."""
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
            hidden = mlp(x, layer.gate_up_proj, layer.down_proj)
        hidden = residual + hidden
        if last_indices is not None:
            hidden = hidden[last_indices]
        hidden = rms_norm(hidden, self.norm, cfg.rms_norm_eps)
        return lm_head(hidden, self.embed_tokens if self.lm_head is None else self.lm_head)

    def _attention(
        self, layer: DecoderLayer, layer_id: int, x: torch.Tensor, cos_sin: torch.Tensor
    ) -> torch.Tensor:
        cfg = self.cfg
        num_tokens = x.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = linear(x, layer.qkv_proj, layer.qkv_bias).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = apply_rope(q, k, cos_sin)
        out = attention(q, k, v.contiguous(), layer_id)
        return linear(out.reshape(num_tokens, q_size), layer.o_proj, layer.o_bias)
