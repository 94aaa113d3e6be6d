"""Reading config.json keys: `_Keys` checks each key's JSON type and range (never coerced) and words
the errors (``<path>: key=value must be ...``), `_rope_config` reads the RoPE keys of either form and
`layer_types` the per-layer attention. Shared by minisgl.models.config, config_families and
gpt_oss_config."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from minisgl.layers.rope import SUPPORTED_ROPE_TYPES, RopeConfig

# upper bounds of the integer keys (see the module docstring)
MAX_WIDTH = 2**20
MAX_VOCAB = 2**24
MAX_COUNT = 2**16
MAX_POSITIONS = 2**31 - 1

SLIDING, FULL = "sliding_attention", "full_attention"  # the values of `layer_types`
_REQUIRED: Any = object()  # the default of a key that must be given


class _Keys:
    """Reads the keys of one JSON object of config.json and checks each one's type and range.

    Errors start with the file and read ``key=value must be ...``; ``names`` maps a key to how messages
    name it where that differs (the RoPE parameters: ``rope_scaling.factor``)."""

    def __init__(
        self, raw: Mapping[str, Any], source: str, context: str = "", names: Mapping[str, str] | None = None
    ) -> None:
        self.raw, self.source, self.context, self.names = raw, source, context, names or {}

    def error(self, key: str, value: Any, valid: str) -> ValueError:
        return ValueError(f"{self.source}: {self.names.get(key, key)}={_show(value)} must be {valid}")

    def get(self, key: str, default: Any) -> tuple[Any, bool]:
        """(value, given): the key's value, or `default` where it is absent or, with a default, null."""
        if key not in self.raw:
            if default is _REQUIRED:
                raise ValueError(f"{self.source}: missing required key {key!r}{self.context}")
            return default, False
        value = self.raw[key]
        if value is None and default is not _REQUIRED:
            return default, False
        return value, True

    def integer(
        self, key: str, default: Any = _REQUIRED, *, ge: int = 1, le: int = MAX_COUNT, why: str = ""
    ) -> Any:
        value, given = self.get(key, default)
        if given and not (_is_int(value) and ge <= value <= le):
            raise self.error(key, value, f"an integer in [{ge}, {le}]{why}")
        return value

    def number(self, key: str, default: Any = _REQUIRED, *, gt: float = 0.0) -> float:
        value, given = self.get(key, default)
        if given and not (_is_finite_number(value) and value > gt):
            raise self.error(key, value, f"a finite number > {gt:g}")
        return float(value) if given else value

    def flag(self, key: str, default: bool = False) -> bool:
        value, given = self.get(key, default)
        if given and not isinstance(value, bool):
            raise self.error(key, value, "true or false")
        return value

    def text(self, key: str, default: Any = _REQUIRED) -> Any:
        value, given = self.get(key, default)
        if given and not isinstance(value, str):
            raise self.error(key, value, "a string")
        return value

    def object(self, key: str) -> dict[str, Any]:
        value, given = self.get(key, {})
        if given and not isinstance(value, dict):
            raise self.error(key, value, "a JSON object or null")
        return value

    def token_ids(self, key: str, vocab_size: int) -> tuple[int, ...]:
        """One token id or a list of them, each in [0, vocab_size)."""
        value, _ = self.get(key, [])
        ids = value if isinstance(value, list) else [value]
        if not all(_is_int(i) and 0 <= i < vocab_size for i in ids):
            raise self.error(
                key, value, f"a token id in [0, {vocab_size - 1}] or a list of them (vocab_size={vocab_size})"
            )
        return tuple(ids)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    """`value` as config.json writes it (true, null, "64"), cut short where it is long."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def layer_types(keys: _Keys, num_layers: int, pattern: int) -> tuple[str, ...]:
    """Each layer's attention (Gemma 2 / 3, gpt-oss): `layer_types`, or every `pattern`-th layer full and
    the others sliding."""
    given, listed = keys.get("layer_types", None)
    if listed:
        if not (isinstance(given, list) and len(given) == num_layers and set(given) <= {SLIDING, FULL}):
            raise keys.error(
                "layer_types", given, f'a list of {num_layers} "{SLIDING}" or "{FULL}" (num_hidden_layers)'
            )
        return tuple(given)
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def _rope_config(keys: _Keys) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta included); older configs write `rope_theta` and
    # `rope_scaling` separately. `rope_parameters` wins where both set a key.
    scaling, params = keys.object("rope_scaling"), keys.object("rope_parameters")
    names = {**{k: f"rope_scaling.{k}" for k in scaling}, **{k: f"rope_parameters.{k}" for k in params}}
    rope = _Keys({**scaling, **params}, keys.source, names=names)
    theta = rope.number("rope_theta", None)
    if theta is None:
        theta = keys.number("rope_theta", 10000.0)
    rope_type = rope.raw.get("rope_type", rope.raw.get("type", "default"))
    if rope_type == "mrope":  # Qwen2.5-VL's older configs: the default frequencies, split by mrope_section
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        key = "rope_type" if "rope_type" in rope.raw else "type"
        raise ValueError(
            f"{keys.source}: {names[key]}={_show(rope_type)} is not supported; minisgl supports rope types "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    low_freq_factor = rope.number("low_freq_factor", 1.0)
    high_freq_factor = rope.number("high_freq_factor", 4.0)
    if rope_type == "llama3" and high_freq_factor <= low_freq_factor:
        raise rope.error("high_freq_factor", high_freq_factor, f"> low_freq_factor={low_freq_factor:g}")
    truncate, _ = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise rope.error("truncate", truncate, "true or false")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=rope.number("factor", 1.0),
        low_freq_factor=low_freq_factor,
        high_freq_factor=high_freq_factor,
        original_max_position_embeddings=rope.integer(
            "original_max_position_embeddings", 8192, le=MAX_POSITIONS
        ),
        beta_fast=rope.number("beta_fast", 32.0),
        beta_slow=rope.number("beta_slow", 1.0),
        truncate=truncate,
        attention_factor=rope.number("attention_factor", None),
    )
