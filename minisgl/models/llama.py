"""Llama-style dense decoders: Llama (2, 3.x, SmolLM2), Mistral (Llama's layers under a sliding attention
window, `ModelConfig.sliding_window`), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), Gemma 2 and 3 (GeGLU,
1 + weight norms folded in at load, four norms a layer, scaled embeddings, soft caps, sliding and full
layers with their own RoPE) and Phi-3 (fused checkpoint projections, partial rotary, LongRoPE): the
families' options of `ModelConfig` (minisgl.models.config_families).

The module only holds weights; `forward` composes the pure functions of `minisgl.layers`, with Q/K/V
and gate/up merged (fewer, larger GEMMs). `checkpoint_map` gives each tensor-parallel rank its `Shard`
of every checkpoint tensor; FP8 projections are `Fp8Linear`, and `kv_scales` hold an FP8 KV cache's
scales. docs/tensor-parallel-and-moe.md ("Sharding"), docs/quantization.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.compile import fused_kernels_mode
from minisgl.core import ImageBatch
from minisgl.distributed import DistributedInfo, all_reduce, divide, get_tp_info, shard_heads
from minisgl.kernels.rope_store import rope_store_applies
from minisgl.layers import (
    add_rms_norm,
    apply_rope,
    attention,
    build_rope_cache,
    embed,
    linear,
    norm_linear,
    norm_linear_keep,
    rms_norm,
    rope_attention,
    rope_cos_sin,
    silu_mul_linear,
)
from minisgl.layers.basic import lm_head
from minisgl.layers.fp8 import Fp8Linear
from minisgl.layers.lora import LoraBatch, lora_add
from minisgl.layers.rope import longrope_positions
from minisgl.models.config import ModelConfig
from minisgl.models.fp8 import (
    KvScale,
    Part,
    Projection,
    check_fp8_split,
    fp8_checkpoint_ignored,
    make_projection,
    projection_map,
)
from minisgl.models.weights import Fused, Shard


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def layer_projections(cfg: ModelConfig, tp: DistributedInfo) -> dict[str, Projection]:
    """This rank's part of each projection of a dense decoder layer (see the module docstring)."""
    heads = shard_heads(cfg.num_heads, cfg.num_kv_heads, tp)
    q = Part(heads.num_heads * cfg.head_dim, tp.rank, tp.size)
    kv = Part(heads.num_kv_heads * cfg.head_dim, heads.kv_part, heads.kv_parts)
    inter = Part(divide(cfg.intermediate_size, tp.size, "intermediate_size"), tp.rank, tp.size)
    hidden = Part(cfg.hidden_size)
    return {
        "qkv_proj": Projection(
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), (q, kv, kv), hidden
        ),
        "o_proj": Projection(("self_attn.o_proj",), (hidden,), q),
        "gate_up_proj": Projection(("mlp.gate_proj", "mlp.up_proj"), (inter, inter), hidden),
        "down_proj": Projection(("mlp.down_proj",), (hidden,), inter),
    }


def check_tensor_parallel_fp8(cfg: ModelConfig, tp: DistributedInfo) -> None:
    """Raises where `tp` would split the FP8 weight blocks of a dense layer's projections."""
    if cfg.quantization is not None:
        check_fp8_split(list(layer_projections(cfg, tp).values()), cfg, tp.size)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tp = tp = get_tp_info()
        self.heads = shard_heads(cfg.num_heads, cfg.num_kv_heads, tp)
        self.projections = projections = layer_projections(cfg, tp)
        hidden, head_dim = cfg.hidden_size, cfg.head_dim
        qkv_rows = projections["qkv_proj"].rows
        self.input_norm = _param(hidden)
        self.qkv_proj = make_projection(projections["qkv_proj"], cfg, tp.size)
        self.qkv_bias = _param(qkv_rows) if cfg.qkv_bias else None
        self.q_norm = _param(head_dim) if cfg.qk_norm else None
        self.k_norm = _param(head_dim) if cfg.qk_norm else None
        self.o_proj = make_projection(projections["o_proj"], cfg, tp.size)
        self.o_bias = _param(hidden) if cfg.o_bias else None  # added once, after the all-reduce
        self.post_norm = _param(hidden)
        self.gate_up_proj = make_projection(projections["gate_up_proj"], cfg, tp.size)
        self.down_proj = make_projection(projections["down_proj"], cfg, tp.size)
        # Gemma: the norms of the attention's and the MLP's outputs (`post_norm` is the one before the MLP)
        self.post_attn_norm = _param(hidden) if cfg.sandwich_norms else None
        self.post_mlp_norm = _param(hidden) if cfg.sandwich_norms else None

    def norms(self) -> list[torch.Tensor]:
        """The layer's RMSNorm weights."""
        norms = (
            self.input_norm,
            self.post_norm,
            self.q_norm,
            self.k_norm,
            self.post_attn_norm,
            self.post_mlp_norm,
        )
        return [norm for norm in norms if norm is not None]

    def checkpoint_map(self, prefix: str, cfg: ModelConfig) -> dict[str, torch.Tensor | Shard]:
        out: dict[str, torch.Tensor | Shard | Fused] = {f"{prefix}.input_layernorm.weight": self.input_norm}
        if self.post_attn_norm is None:
            out[f"{prefix}.post_attention_layernorm.weight"] = self.post_norm
        else:
            out[f"{prefix}.post_attention_layernorm.weight"] = self.post_attn_norm
            out[f"{prefix}.pre_feedforward_layernorm.weight"] = self.post_norm
            out[f"{prefix}.post_feedforward_layernorm.weight"] = self.post_mlp_norm
        for attr, projection in self.projections.items():
            weight: torch.Tensor | Fp8Linear = getattr(self, attr)
            entries = projection_map(prefix, projection, weight, cfg)
            if cfg.fused_checkpoint and len(projection.names) > 1:  # Phi-3: one tensor of the merged rows
                if cfg.quantization is not None and cfg.quantization.in_checkpoint:
                    raise ValueError(
                        f"FP8 checkpoints of {cfg.architecture} (fused {attr}) are not supported; load the "
                        "unquantized checkpoint with the setting quantization: fp8"
                    )
                parts = tuple(entries.pop(f"{prefix}.{name}.weight") for name in projection.names)
                module = "self_attn" if attr == "qkv_proj" else "mlp"
                entries[f"{prefix}.{module}.{attr}.weight"] = Fused(parts)
            out.update(entries)
        qkv = self.projections["qkv_proj"]
        for index, name, rows in qkv.row_slices():
            segment = qkv.segments[index]
            if self.qkv_bias is not None:
                out[f"{prefix}.{name}.bias"] = Shard(self.qkv_bias[rows], 0, segment.part, segment.parts)
        if self.o_bias is not None:
            out[f"{prefix}.self_attn.o_proj.bias"] = self.o_bias
        if self.q_norm is not None:
            out[f"{prefix}.self_attn.q_norm.weight"] = self.q_norm
            out[f"{prefix}.self_attn.k_norm.weight"] = self.k_norm
        return out


class LlamaForCausalLM(nn.Module):
    """Serves LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM checkpoints, and
    those of the bare models (LlamaModel, ...: no LM head, names without `model.`), for embeddings."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp: DistributedInfo = get_tp_info()
        # this rank's slice of the vocabulary, padded when the ranks do not divide it (the last rows of the
        # last ranks are zeros, never looked up, and their logits are cut off after the gather)
        vocab = -(-cfg.vocab_size // self.tp.size)
        self.embed_tokens = _param(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size)
        untied = cfg.has_lm_head and not cfg.tie_word_embeddings
        self.lm_head = _param(vocab, cfg.hidden_size) if untied else None
        self.prefix = "model." if cfg.has_lm_head else ""  # of the checkpoint's decoder names
        self.max_seq_len = max_seq_len
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim
        device = self.embed_tokens.device
        table = build_rope_cache(self.rotary_dim, max_seq_len, cfg.rope, device)
        self.register_buffer("cos_sin", table, persistent=False)
        # Gemma 3: the sliding layers' RoPE table (their own base); None: every layer reads `cos_sin`
        local = (
            None if cfg.local_rope is None else build_rope_cache(self.rotary_dim, max_seq_len, cfg.local_rope)
        )
        self.register_buffer("cos_sin_local", None if local is None else local.to(device), persistent=False)
        self.local_layers = {i for i in range(cfg.num_layers) if cfg.layer_window(i) is not None}
        # Gemma: sqrt(hidden_size) in the model's dtype (transformers rounds it so)
        self.embed_multiplier = (
            float(torch.tensor(cfg.hidden_size**0.5, dtype=self.embed_tokens.dtype))
            if cfg.embed_scale
            else None
        )
        self._init_kv_scales(cfg.num_layers)
        self.mrope_axes: torch.Tensor | None = None  # M-RoPE's column axes (minisgl.models.qwen_vl)
        # the engine's LoRA adapter slots (`minisgl.lora.LoraPool`), set by an engine with LoRA enabled:
        # then a forward given a `lora` batch adds each row's adapter delta to the targeted projections
        self.lora_pool = None

    def _init_kv_scales(self, num_layers: int) -> None:
        """(layers, 2) float32: each layer's K and V scale of an FP8 KV cache (1.0 unless the checkpoint
        gives them; unused with a KV cache in the model's dtype)."""
        ones = torch.ones(num_layers, 2, dtype=torch.float32, device=self.embed_tokens.device)
        self.register_buffer("kv_scales", ones, persistent=False)

    def checkpoint_map(self) -> dict[str, torch.Tensor | Shard]:
        rank, size = self.tp.rank, self.tp.size
        out: dict[str, torch.Tensor | Shard] = {
            f"{self.prefix}embed_tokens.weight": Shard(self.embed_tokens, 0, rank, size, self.cfg.vocab_size),
            f"{self.prefix}norm.weight": self.norm,
        }
        if self.lm_head is not None:
            out["lm_head.weight"] = Shard(self.lm_head, 0, rank, size, self.cfg.vocab_size)
        for i, layer in enumerate(self.layers):
            out.update(layer.checkpoint_map(f"{self.prefix}layers.{i}", self.cfg))
        out.update(self._kv_scale_map())
        return out

    def _kv_scale_map(self) -> dict[str, KvScale]:
        return {
            f"{self.prefix}layers.{i}.self_attn.{kind}_scale": KvScale(self.kv_scales[i, j])
            for i in range(len(self.layers))
            for j, kind in enumerate("kv")
        }

    def checkpoint_optional(self) -> frozenset[str]:
        """Checkpoint tensors the model takes where they are present: the KV-cache scales."""
        return frozenset(self._kv_scale_map())

    @torch.no_grad()
    def after_load(self) -> None:
        """Gemma's norms scale by 1 + weight: the 1 is added to the loaded weights once (every kernel then
        runs them as plain RMSNorm weights)."""
        if self.cfg.norm_offset:
            for norm in [self.norm, *(n for layer in self.layers for n in layer.norms())]:
                norm.add_(self.cfg.norm_offset)

    def checkpoint_ignored(self) -> frozenset[str]:
        # tied checkpoints sometimes still store a copy of the embedding as lm_head
        tied = frozenset({"lm_head.weight"}) if self.lm_head is None else frozenset()
        return tied | fp8_checkpoint_ignored(self.cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        last_indices: torch.Tensor | None = None,
        lora: LoraBatch | None = None,
        images: ImageBatch | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Tokens (T,) at positions (T,) -> float32 logits of each request's last token (or of every row
        when `last_indices` is None). `lora`: each row's adapter slot of `lora_pool` (without a pool, or
        None: the base model, and not one op more). Vision-language models (minisgl.models.qwen_vl):
        positions may be (3, T) M-RoPE positions, and `images` the embeddings of the image tokens.
        `return_hidden`: (logits, every row's `hidden_states`), what the compiled forward gives so that
        embedding inputs pool from it."""
        hidden = self.hidden_states(input_ids, positions, lora, images, last_indices)
        rows = hidden if last_indices is None else hidden[last_indices]
        logits = self.logits(self.final_norm(rows))
        return (logits, hidden) if return_hidden else logits

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's last norm over rows of `hidden_states` (what transformers' `last_hidden_state` is)."""
        return rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of rows after `final_norm` (a bare model's head is its tied embedding), soft-capped
        where the model caps them (Gemma 2)."""
        logits = lm_head(
            hidden, self.embed_tokens if self.lm_head is None else self.lm_head, self.cfg.vocab_size
        )
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        lora: LoraBatch | None = None,
        images: ImageBatch | None = None,
        last_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every row's hidden state after the last decoder layer, before the final norm (`images`,
        `last_indices`: as `forward` takes them; LongRoPE reads the requests' extents from the latter)."""
        cfg = self.cfg
        lora = lora if self.lora_pool is not None else None
        hidden = embed(input_ids, self.embed_tokens)
        if self.embed_multiplier is not None:
            hidden = hidden * self.embed_multiplier
        if cfg.rope.rope_type == "longrope":  # the rows of the short or the long factors' table
            original = cfg.rope.original_max_position_embeddings
            positions = longrope_positions(positions, last_indices, original, self.max_seq_len)
        if images is not None:  # image embeddings replace those of their placeholder tokens
            hidden = hidden.index_copy(0, images.rows, images.embeds.to(hidden.dtype))
        # the fused q/k-norm + RoPE + KV-store kernel reads cos and sin itself (1D positions only); the
        # unfused path looks the rows up once per forward
        fused_rope = (
            fused_kernels_mode()
            and positions.dim() == 1
            and self.rotary_dim == cfg.head_dim
            and rope_store_applies(hidden, cfg.head_dim)
        )
        tables = [self.cos_sin] if self.cos_sin_local is None else [self.cos_sin, self.cos_sin_local]
        ropes = [
            positions if fused_rope else rope_cos_sin(positions, table, hidden.dtype, self.mrope_axes)
            for table in tables
        ]
        residual = None  # the first layer's input norm has no residual to add
        for layer_id, layer in enumerate(self.layers):
            qkv, residual = self._norm_linear(
                layer_id, "qkv_proj", hidden, residual, layer.input_norm, layer.qkv_proj, layer.qkv_bias, lora
            )
            local = (
                1 if len(tables) > 1 and layer_id in self.local_layers else 0
            )  # an index (dynamo: no bool)
            hidden = self._attention(layer, layer_id, qkv, ropes[local], fused_rope, lora, tables[local])
            if layer.post_attn_norm is not None:
                hidden = rms_norm(hidden, layer.post_attn_norm, cfg.rms_norm_eps)
            hidden, residual = self._mlp(layer, layer_id, hidden, residual, lora)
            if layer.post_mlp_norm is not None:
                hidden = rms_norm(hidden, layer.post_mlp_norm, cfg.rms_norm_eps)
            if images is not None and layer_id < len(images.deepstack):  # Qwen3-VL's DeepStack features
                hidden = hidden.index_add(0, images.rows, images.deepstack[layer_id].to(hidden.dtype))
        return residual + hidden

    def _lora(
        self, lora: LoraBatch | None, layer_id: int, projection: str, x: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """`out` (the projection's fresh output for input x) plus each row's LoRA delta, in place; `out`
        itself without a batch or where the pool has no such projection (a MoE model's MLP)."""
        pool = self.lora_pool
        if lora is None or projection not in pool.sizes:
            return out
        a, b = pool.weights(layer_id, projection)
        return lora_add(x, out, a, b, lora, pool.sizes[projection], pool.ranks)

    def _norm_linear(
        self,
        layer_id: int,
        projection: str,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        weight: torch.Tensor | Fp8Linear,
        bias: torch.Tensor | None,
        lora: LoraBatch | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`norm_linear`, plus the LoRA delta of the normalised rows with a batch (the fused one-row
        kernel of `norm_linear` does not give them; `norm_linear_keep`'s does)."""
        eps = self.cfg.rms_norm_eps
        if lora is None or projection not in self.lora_pool.sizes:
            return norm_linear(x, residual, norm_weight, eps, weight, bias)
        if residual is not None and bias is None:
            out, normed, residual = norm_linear_keep(x, residual, norm_weight, eps, weight)
        else:
            normed, residual = (
                (rms_norm(x, norm_weight, eps), x)
                if residual is None
                else add_rms_norm(x, residual, norm_weight, eps)
            )
            out = linear(normed, weight, bias)
        return self._lora(lora, layer_id, projection, normed, out), residual

    def _mlp(
        self,
        layer: DecoderLayer,
        layer_id: int,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The post-attention norm (of hidden + residual) and the MLP: (MLP output, new residual). The
        row-parallel down projection's output is all-reduced (its LoRA delta added before)."""
        gate_up, residual = self._norm_linear(
            layer_id, "gate_up_proj", hidden, residual, layer.post_norm, layer.gate_up_proj, None, lora
        )
        if lora is None or "down_proj" not in self.lora_pool.sizes:
            return all_reduce(silu_mul_linear(gate_up, layer.down_proj, self.cfg.hidden_act)), residual
        gate, up = gate_up.chunk(2, dim=-1)
        act = (F.silu(gate) if self.cfg.hidden_act == "silu" else F.gelu(gate, approximate="tanh")) * up
        return all_reduce(
            self._lora(lora, layer_id, "down_proj", act, linear(act, layer.down_proj))
        ), residual

    def _attention(
        self,
        layer: DecoderLayer,
        layer_id: int,
        qkv: torch.Tensor,
        rope: torch.Tensor,
        fused_rope: bool,
        lora: LoraBatch | None = None,
        table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention from the QKV projection's output, then the row-parallel o_proj (its LoRA delta added
        before the all-reduce). `rope`: the positions (fused kernel, which reads `table`, the layer's
        RoPE table) or the cos and sin rows of `rope_cos_sin` (unfused)."""
        cfg, heads = self.cfg, layer.heads  # this rank's heads
        num_tokens = qkv.shape[0]
        q_size, kv_size = heads.num_heads * cfg.head_dim, heads.num_kv_heads * cfg.head_dim
        if fused_rope:
            out = rope_attention(
                qkv, rope, self.cos_sin if table is None else table, layer.q_norm, layer.k_norm, cfg.rms_norm_eps, layer_id,
                heads.num_heads, heads.num_kv_heads, cfg.head_dim,
            )  # fmt: skip
        else:
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(num_tokens, heads.num_heads, cfg.head_dim)
            k = k.view(num_tokens, heads.num_kv_heads, cfg.head_dim)
            v = v.view(num_tokens, heads.num_kv_heads, cfg.head_dim)
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
            q, k = apply_rope(q, k, rope)
            out = attention(q, k, v.contiguous(), layer_id)
        out = out.reshape(num_tokens, q_size)
        out = all_reduce(self._lora(lora, layer_id, "o_proj", out, linear(out, layer.o_proj)))
        return out if layer.o_bias is None else out + layer.o_bias
