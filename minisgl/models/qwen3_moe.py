"""Qwen3-MoE (Qwen3-30B-A3B and kin): the Qwen3 decoder with a mixture-of-experts MLP.

Everything but the MLP of sparse layers (`ModelConfig.is_sparse_layer`) is inherited from
`minisgl.models.llama`. A sparse layer holds a router `gate` (E, H), `w13` (E, 2I, H: gate rows [0, I),
up rows [I, 2I)) and `w2` (E, H, I), plain or, from a 4- or 8-bit checkpoint on CUDA, packed
(`PackedLinear` with an experts dimension); `minisgl.moe.moe` runs the engine's backend. Under tensor
parallelism every rank holds every expert's part of I and the MoE output is all-reduced in `_mlp`.
docs/tensor-parallel-and-moe.md.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from minisgl.distributed import all_reduce, divide
from minisgl.layers import norm_linear_keep
from minisgl.layers.packed import PackedLinear
from minisgl.models.config import ModelConfig
from minisgl.models.llama import DecoderLayer, LlamaForCausalLM, _param
from minisgl.models.packed import Dense, Packed, experts_packed, module_map
from minisgl.models.quant_config import PackedConfig
from minisgl.models.weights import Shard
from minisgl.moe import moe


class SparseDecoderLayer(DecoderLayer):
    """Qwen3's attention and norms; the MLP is a router plus fused experts. The parent's dense MLP
    weights are built with zero rows (so its attention code and checkpoint map are reused unchanged).
    Under tensor parallelism each expert holds this rank's part of its intermediate dimension."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(dataclasses.replace(cfg, intermediate_size=0))
        num_experts, hidden = cfg.num_experts, cfg.hidden_size
        inter = divide(cfg.moe_intermediate_size, self.tp.size, "moe_intermediate_size")  # local
        self.gate = _param(num_experts, hidden)
        packed = cfg.quantization if isinstance(cfg.quantization, PackedConfig) else None
        self.w13: nn.Parameter | PackedLinear
        self.w2: nn.Parameter | PackedLinear
        if packed is not None and experts_packed(packed, torch.get_default_device()):
            group = packed.group
            self.w13 = PackedLinear((inter, inter), hidden, packed.bits, group, experts=num_experts)
            self.w2 = PackedLinear((hidden,), inter, packed.bits, group, experts=num_experts)
        else:
            self.w13 = _param(num_experts, 2 * inter, hidden)
            self.w2 = _param(num_experts, hidden, inter)

    def checkpoint_map(self, prefix: str, cfg: ModelConfig) -> dict[str, torch.Tensor | Shard]:
        out = {k: v for k, v in super().checkpoint_map(prefix, cfg).items() if ".mlp." not in k}
        out[f"{prefix}.mlp.gate.weight"] = self.gate  # replicated
        rank, size = self.tp.rank, self.tp.size
        hidden, inter = self.w2.shape[-2:]  # local
        packed = cfg.quantization if isinstance(cfg.quantization, PackedConfig) else None
        for e in range(cfg.num_experts):
            experts = f"{prefix}.mlp.experts.{e}"
            if packed is not None:  # a 4- or 8-bit checkpoint: packed, or dequantized at load
                for name, index, split in (("gate_proj", 0, 0), ("up_proj", 1, 0), ("down_proj", 0, 1)):
                    weight = self.w13 if split == 0 else self.w2
                    if isinstance(weight, PackedLinear):
                        sink: Dense | Packed = Packed(weight, index, expert=e)
                    else:
                        sink = Dense(
                            weight[e, index * inter : (index + 1) * inter] if split == 0 else weight[e]
                        )
                    shape = (inter, hidden) if split == 0 else (hidden, inter)
                    out.update(module_map(packed, f"{experts}.{name}", shape, (split, rank, size), sink))
                continue
            out[f"{experts}.gate_proj.weight"] = Shard(self.w13[e, :inter], 0, rank, size)
            out[f"{experts}.up_proj.weight"] = Shard(self.w13[e, inter:], 0, rank, size)
            out[f"{experts}.down_proj.weight"] = Shard(self.w2[e], 1, rank, size)
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
        self._init_kv_scales(cfg.num_layers)

    def _mlp(self, layer, layer_id, hidden, residual, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`LlamaForCausalLM._mlp`'s arguments. The sparse layers' MLP is the mixture of experts; dense layers keep the gated MLP. Both are
        row-parallel under tensor parallelism: each rank's output is a partial sum, all-reduced. LoRA
        adapters change the attention projections only (`minisgl.lora.lora_projections`)."""
        if not isinstance(layer, SparseDecoderLayer):
            return super()._mlp(layer, layer_id, hidden, residual, lora)
        # the norm and the replicated router (every rank picks the same experts), one kernel at a token
        router_logits, x, residual = norm_linear_keep(
            hidden, residual, layer.post_norm, self.cfg.rms_norm_eps, layer.gate
        )
        w13, w2 = (w.experts_weights() if isinstance(w, PackedLinear) else w for w in (layer.w13, layer.w2))
        out = moe(x, router_logits, w13, w2, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)
        return all_reduce(out), residual
