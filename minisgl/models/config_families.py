"""The config.json keys of Gemma 2, Gemma 3 and Phi-3 (`ModelConfig` fields beyond Llama's), in either
form: as the published checkpoints write them (`rope_theta`, `rope_scaling`, `rope_local_base_freq`,
`sliding_window_pattern`, a top-level `partial_rotary_factor` and `original_max_position_embeddings`)
and as transformers 5 saves them (`rope_parameters`, per layer type for Gemma 3; `layer_types`).
docs/usage.md ("Models").
"""

from __future__ import annotations

import math
from typing import Any

from minisgl.layers.rope import RopeConfig
from minisgl.models.config_keys import FULL, MAX_POSITIONS, SLIDING, _Keys, _rope_config, _show, layer_types

FAMILIES = ("gemma2", "gemma3", "phi3")
GEMMA_FAMILIES = ("gemma2", "gemma3")
# transformers' Gemma3TextConfig defaults: the published Gemma 3 4B-27B config.json files leave most
# keys of their text_config to them
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")  # GELU, tanh approximation
GEMMA_DEFAULT_THETA = {"gemma2": (10000.0, 10000.0), "gemma3": (1000000.0, 10000.0)}  # (full, sliding)


def family_fields(keys: _Keys, family: str, num_layers: int, head_dim: int) -> dict[str, Any]:
    """The `ModelConfig` fields of `family` (one of FAMILIES) that Llama's keys do not give."""
    if family == "phi3":
        return _phi3(keys, head_dim)
    activation, _ = keys.get("hidden_activation", None)
    if activation is None:
        activation, _ = keys.get("hidden_act", "gelu_pytorch_tanh")
    if activation not in GEMMA_ACTIVATIONS:
        raise ValueError(
            f"{keys.source}: hidden_activation={_show(activation)} is not supported for {family}; minisgl "
            'supports "gelu_pytorch_tanh"'
        )
    if keys.flag("use_bidirectional_attention"):
        raise ValueError(
            f"{keys.source}: use_bidirectional_attention=true (an embedding model's encoder) is not "
            "supported; minisgl runs Gemma as a causal decoder"
        )
    full_rope, local_rope = _gemma_rope(keys, family)
    gemma2 = family == "gemma2"
    return dict(
        hidden_act="gelu_tanh",
        norm_offset=1.0,
        sandwich_norms=True,
        qk_norm=family == "gemma3",
        embed_scale=True,
        attn_scale=keys.number("query_pre_attn_scalar", float(head_dim)) ** -0.5,
        attn_softcap=_absent_or(keys, "attn_logit_softcapping", 50.0 if gemma2 else None, keys.number),
        final_softcap=_absent_or(keys, "final_logit_softcapping", 30.0 if gemma2 else None, keys.number),
        sliding_window=_absent_or(keys, "sliding_window", 4096, keys.integer, le=MAX_POSITIONS),
        # Gemma 2: sliding, full, ...; Gemma 3: five sliding, then one full (`sliding_window_pattern`)
        layer_types=layer_types(keys, num_layers, 2 if gemma2 else keys.integer("sliding_window_pattern", 6)),
        rope=full_rope,
        local_rope=local_rope,
        tie_word_embeddings=keys.flag("tie_word_embeddings", True),
    )


def _absent_or(keys: _Keys, key: str, default: Any, read: Any, **bounds: Any) -> Any:
    """transformers' `default` where the key is absent; null stays None (none: no cap, no window)."""
    return read(key, None, **bounds) if key in keys.raw else default


def _gemma_rope(keys: _Keys, family: str) -> tuple[RopeConfig, RopeConfig | None]:
    """(the full layers' RoPE, Gemma 3's sliding layers' or None: the same)."""
    full_theta, local_theta = GEMMA_DEFAULT_THETA[family]
    params = keys.object("rope_parameters")
    if family == "gemma2" or not (
        isinstance(params.get(FULL), dict) or isinstance(params.get(SLIDING), dict)
    ):
        raw = {"rope_theta": full_theta, **keys.raw}  # published form (or Gemma 2's flat rope_parameters)
        full = _rope_config(_Keys(raw, keys.source, keys.context))
        if family == "gemma2":
            return full, None
        local = RopeConfig(theta=keys.number("rope_local_base_freq", local_theta))
        return full, local
    ropes = []
    for kind, theta in ((FULL, full_theta), (SLIDING, local_theta)):
        sub = params.get(kind) or {}
        if not isinstance(sub, dict):
            raise keys.error(f"rope_parameters.{kind}", sub, "a JSON object")
        raw = {"rope_theta": theta, "rope_parameters": sub}
        ropes.append(_rope_config(_Keys(raw, keys.source, keys.context)))
    return ropes[0], ropes[1]


def _phi3(keys: _Keys, head_dim: int) -> dict[str, Any]:
    """Phi-3's fields: fused checkpoint projections, partial rotary, LongRoPE, its sliding window."""
    rope = {**keys.object("rope_scaling"), **keys.object("rope_parameters")}
    factor = rope.get("partial_rotary_factor", keys.raw.get("partial_rotary_factor", 1.0))
    if not (isinstance(factor, int | float) and not isinstance(factor, bool) and 0 < factor <= 1):
        raise keys.error("partial_rotary_factor", factor, "a number in (0, 1]")
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or rotary_dim < 2:
        raise ValueError(
            f"{keys.source}: partial_rotary_factor={_show(factor)} of head_dim {head_dim} rotates "
            f"{rotary_dim} columns; it must be a positive even number"
        )
    config = _rope_config(keys)
    if config.rope_type == "longrope":
        config = _longrope(keys, rope, config, rotary_dim)
    return dict(
        rope=config,
        rotary_dim=rotary_dim,
        fused_checkpoint=True,
        sliding_window=keys.integer("sliding_window", None, le=MAX_POSITIONS),
    )


def _longrope(keys: _Keys, rope: dict[str, Any], config: RopeConfig, rotary_dim: int) -> RopeConfig:
    """LongRoPE's factors (rotary_dim / 2 of each) and scales, as transformers computes them."""
    factors = []
    for name in ("short_factor", "long_factor"):
        value = rope.get(name)
        if not (
            isinstance(value, list)
            and len(value) == rotary_dim // 2
            and all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in value)
        ):
            raise keys.error(f"rope_scaling.{name}", value, f"a list of {rotary_dim // 2} positive numbers")
        factors.append(tuple(float(v) for v in value))
    max_positions = keys.integer("max_position_embeddings", 4096, le=MAX_POSITIONS)
    original = rope.get("original_max_position_embeddings", keys.raw.get("original_max_position_embeddings"))
    if original is None:
        original = max_positions
    if not (isinstance(original, int) and not isinstance(original, bool) and 1 <= original <= MAX_POSITIONS):
        raise keys.error("original_max_position_embeddings", original, f"an integer in [1, {MAX_POSITIONS}]")
    factor = rope.get("factor") or max_positions / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = (
            1.0 if factor <= 1.0 or original == 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return RopeConfig(
        theta=config.theta,
        rope_type="longrope",
        original_max_position_embeddings=original,
        short_factor=factors[0],
        long_factor=factors[1],
        attention_factor=float(attention),
    )
