"""The `ModelConfig` fields of a gpt-oss config.json (minisgl.models.gpt_oss), read by
minisgl.models.config (apart from the model so that reading a config imports no model)."""

from __future__ import annotations

from typing import Any

from minisgl.models.config_keys import MAX_POSITIONS, _Keys, layer_types
from minisgl.models.mxfp4 import check_mxfp4_shape

DEFAULT_WINDOW = 128  # transformers' GptOssConfig


def gpt_oss_fields(keys: _Keys, num_layers: int) -> dict[str, Any]:
    """The fields of a gpt-oss config.json (`keys`: minisgl.models.config's reader of it), as published (`rope_scaling`, `rope_theta`,
    `quantization_config` of MXFP4) or as transformers 5 saves it (`rope_parameters`); `window` is the
    sliding window (the caller's `sliding_window`)."""
    raw = keys.raw
    window = None if "sliding_window" in raw and raw["sliding_window"] is None else DEFAULT_WINDOW
    window = keys.integer("sliding_window", window, le=MAX_POSITIONS)
    experts_key = "num_local_experts" if "num_local_experts" in raw else "num_experts"
    num_experts = keys.integer(experts_key)
    top_k_key = "num_experts_per_tok" if "num_experts_per_tok" in raw else "experts_per_token"
    inter = keys.integer("intermediate_size", le=2**20)
    return dict(
        window=window,
        layer_types=layer_types(keys, num_layers, 2),  # transformers' default: sliding, full, ...
        attention_sinks=True,
        num_experts=num_experts,
        num_experts_per_tok=keys.integer(top_k_key, 4, le=num_experts, why=f" ({experts_key}={num_experts})"),
        moe_intermediate_size=inter,
        norm_topk_prob=True,
        swiglu_limit=keys.number("swiglu_limit", 7.0),
        swiglu_alpha=keys.number("swiglu_alpha", 1.702),
        mxfp4_experts=_mxfp4(keys, inter),
    )


def _mxfp4(keys: _Keys, inter: int) -> bool:
    """Whether the checkpoint's experts are MXFP4 (`quantization_config.quant_method: mxfp4`)."""
    quant = keys.object("quantization_config")
    if not quant:
        return False
    method = quant.get("quant_method")
    if method != "mxfp4":
        raise keys.error(
            "quantization_config.quant_method", method, '"mxfp4" for gpt-oss (or no quantization_config)'
        )
    check_mxfp4_shape("intermediate_size", inter)
    check_mxfp4_shape("hidden_size", keys.integer("hidden_size"))
    return True
