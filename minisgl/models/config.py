"""ModelConfig: the architecture facts minisgl needs, read from a model folder's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl.layers.rope import SUPPORTED_ROPE_TYPES, RopeConfig

# architecture name in config.json -> model family implemented in minisgl.models
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None
    # mixture of experts (Qwen3-MoE); dense models have num_experts == 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse_layer(self, layer_id: int) -> bool:
        """True where the layer's MLP is a mixture of experts (transformers' Qwen3-MoE rule)."""
        return (
            layer_id not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; minisgl supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]

        def need(key: str) -> Any:
            if key not in raw:
                raise ValueError(f"{source}: missing required key {key!r} for {arch}")
            return raw[key]

        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"{source}: hidden_act={hidden_act!r} is not supported; minisgl supports 'silu'")
        if raw.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        if raw.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported")

        hidden_size, num_heads = int(need("hidden_size")), int(need("num_attention_heads"))
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(raw.get("attention_bias", False))
        moe: dict[str, Any] = {}
        if family == "qwen3_moe":
            # transformers 5 writes `num_local_experts`; the hub's config.json files say `num_experts`
            num_experts = raw.get("num_experts", raw.get("num_local_experts"))
            if num_experts is None:
                raise ValueError(f"{source}: missing required key 'num_experts' for {arch}")
            moe = dict(
                num_experts=int(num_experts),
                num_experts_per_tok=int(need("num_experts_per_tok")),
                moe_intermediate_size=int(need("moe_intermediate_size")),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),  # transformers' default
                decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
                mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
            )
            if not 0 < moe["num_experts_per_tok"] <= moe["num_experts"]:
                raise ValueError(
                    f"{source}: num_experts_per_tok={moe['num_experts_per_tok']} must be in "
                    f"[1, num_experts={moe['num_experts']}]"
                )
        return cls(
            architecture=arch,
            family=family,
            hidden_size=hidden_size,
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(raw, source),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            # transformers' Llama, Qwen2 and Qwen3 configs default to untied embeddings
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            **moe,
        )

    @classmethod
    def from_path(cls, model_path: str | Path) -> ModelConfig:
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {str(model_path)!r}")
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f), source=str(path))


def _rope_config(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta included); older configs write `rope_theta` and
    # `rope_scaling` separately.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope type {rope_type!r} is not supported; minisgl supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
