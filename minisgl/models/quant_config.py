"""The integer weight-only checkpoint formats (AWQ, GPTQ, compressed-tensors pack-quantized): config.json's
`quantization_config` read into one `PackedConfig`; everything else of those methods is refused, naming
the field and its value. The tensors: minisgl.models.packed; docs/quantization.md ("4- and 8-bit weights").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# quantization_config.quant_method of the formats read here
PACKED_METHODS = ("awq", "gptq", "compressed-tensors")
# the projections of a decoder layer, as the checkpoints name their modules
PROJECTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class PackedConfig:
    """Integer weights, `bits` 4 or 8, one scale and zero point per `group` input columns of each output
    row (None: one group of all columns, per channel). `method`: the checkpoint's format (its tensors:
    minisgl.models.packed); `zero_offset`: added to a stored zero point (GPTQ's v1 format stores zero - 1);
    `ignore`: compressed-tensors' `ignore` list (module names, or `re:` patterns), whose modules keep
    plain weights; `desc_act`: GPTQ's act order (a `g_idx` per input column)."""

    method: str
    bits: int
    group: int | None
    sym: bool = False
    zero_offset: int = 0
    desc_act: bool = False
    ignore: tuple[str, ...] = ()

    @property
    def pack(self) -> int:
        """Values per int32 word."""
        return 32 // self.bits

    def ignored(self, module: str) -> bool:
        """Whether the checkpoint keeps module `module` (e.g. "model.layers.0.mlp.down_proj") unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry):
                return True
        return False

    def describe(self) -> str:
        group = "per channel" if self.group is None else f"groups of {self.group}"
        zeros = "symmetric" if self.sym else "with zero points"
        return f"{self.bits}-bit {self.method} weights, {group}, {zeros}"


def _show(value: Any) -> str:
    text = (
        json.dumps(value) if isinstance(value, str | int | float | bool | list | dict | None) else repr(value)
    )
    return text if len(text) <= 80 else text[:77] + "..."


class _Fields:
    """Reads `quantization_config` (or a part of it, `prefix` naming where) and raises naming the field."""

    def __init__(self, raw: dict[str, Any], source: str, prefix: str = "quantization_config.") -> None:
        self.raw, self.source, self.prefix = raw, source, prefix

    def refuse(self, key: str, value: Any, why: str) -> ValueError:
        return ValueError(f"{self.source}: {self.prefix}{key}={_show(value)} is not supported: {why}")

    def one_of(self, key: str, default: Any, allowed: tuple[Any, ...], why: str) -> Any:
        value = self.raw.get(key, default)
        if isinstance(value, str) and all(isinstance(a, str) for a in allowed):
            value = value.lower()
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise self.refuse(key, value, why)
        return value

    def group(self, key: str, per_channel: tuple[Any, ...] = (-1,)) -> int | None:
        value = self.raw.get(key)
        if value in per_channel and not isinstance(value, bool):
            return None
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0 and value % 8 == 0):
            raise self.refuse(
                key, value, "a group size must be a positive multiple of 8 (or -1: per channel)"
            )
        return value


BITS_4 = "minisgl reads 4-bit weights of this format"
BITS_4_8 = "minisgl reads 4- and 8-bit weights"


def parse_packed(raw: dict[str, Any], source: str) -> PackedConfig:
    """`raw` (config.json's quantization_config, its quant_method one of `PACKED_METHODS`) as a
    `PackedConfig`, or a ValueError naming the field that minisgl does not read."""
    fields = _Fields(raw, source)
    method = raw["quant_method"]
    if method == "awq":
        fields.one_of("version", "gemm", ("gemm",), 'minisgl reads AWQ\'s "gemm" layout')
        fields.one_of("bits", None, (4,), BITS_4)
        fields.one_of("zero_point", True, (True,), "minisgl reads AWQ checkpoints with zero points")
        config = PackedConfig("awq", 4, fields.group("group_size", ()))
        skipped = raw.get("modules_to_not_convert") or []
        _check_all_quantized(
            fields, "modules_to_not_convert", skipped, lambda name: any(s in name for s in skipped)
        )
        return config
    if method == "gptq":
        bits = fields.one_of("bits", None, (4, 8), BITS_4_8)
        fmt = fields.one_of(
            "checkpoint_format", "gptq", ("gptq", "gptq_v2"), 'minisgl reads the "gptq" and "gptq_v2" formats'
        )
        sym = fields.one_of("sym", True, (True, False), "true or false")
        desc_act = fields.one_of("desc_act", False, (True, False), "true or false")
        if raw.get("dynamic"):
            raise fields.refuse("dynamic", raw["dynamic"], "per-module overrides are not read")
        blocks = raw.get("modules_in_block_to_quantize")
        if blocks:
            listed = {
                n.rsplit(".", 1)[-1] for part in blocks for n in (part if isinstance(part, list) else [part])
            }
            if not set(PROJECTION_NAMES) <= listed:
                raise fields.refuse(
                    "modules_in_block_to_quantize", blocks, "every projection of a layer must be quantized"
                )
        group = fields.group("group_size")
        return PackedConfig(
            "gptq", bits, group, sym, 1 if fmt == "gptq" else 0, desc_act and group is not None
        )
    return _compressed_tensors(fields)


def _check_all_quantized(fields: _Fields, key: str, entries: Any, ignored) -> None:
    """Refuses a list that leaves some projection of the decoder layers unquantized."""
    hit = next((n for n in PROJECTION_NAMES if ignored(f"model.layers.0.self_attn.{n}")), None)
    hit = hit or next((n for n in PROJECTION_NAMES if ignored(f"model.layers.0.mlp.{n}")), None)
    if hit is not None:
        raise fields.refuse(key, entries, f"it leaves {hit} unquantized (mixed layers are not read)")


def _compressed_tensors(fields: _Fields) -> PackedConfig:
    raw = fields.raw
    for key in ("sparsity_config", "kv_cache_scheme", "transform_config"):
        if raw.get(key):
            raise fields.refuse(key, raw[key], "only weight quantization is read")
    groups = raw.get("config_groups")
    if not (isinstance(groups, dict) and len(groups) == 1):
        raise fields.refuse("config_groups", groups, "minisgl reads exactly one quantization scheme")
    name, scheme = next(iter(groups.items()))
    if not isinstance(scheme, dict):
        raise fields.refuse(f"config_groups.{name}", scheme, "a scheme must be an object")
    at = _Fields(scheme, fields.source, f"quantization_config.config_groups.{name}.")
    packed = ("pack-quantized",)
    (fields if raw.get("format") else at).one_of("format", None, packed, 'minisgl reads "pack-quantized"')
    if raw.get("format") and scheme.get("format"):
        at.one_of("format", None, packed, 'minisgl reads "pack-quantized"')
    for key in ("input_activations", "output_activations"):
        if scheme.get(key):
            raise at.refuse(
                key, scheme[key], "activation quantization is not read (weights only: W4A16, W8A16)"
            )
    targets = scheme.get("targets")
    if targets != ["Linear"]:
        raise at.refuse("targets", targets, 'minisgl reads schemes of targets ["Linear"]')
    weights = scheme.get("weights")
    if not isinstance(weights, dict):
        raise at.refuse("weights", weights, "a scheme needs its weights' quantization")
    w = _Fields(weights, fields.source, f"{at.prefix}weights.")
    w.one_of("type", "int", ("int",), "minisgl reads integer weights")
    bits = w.one_of("num_bits", None, (4, 8), BITS_4_8)
    strategy = w.one_of("strategy", None, ("group", "channel"), 'minisgl reads "group" and "channel" scales')
    sym = w.one_of("symmetric", True, (True, False), "true or false")
    w.one_of("dynamic", False, (False,), "weights need their scales in the checkpoint")
    if weights.get("actorder"):
        raise w.refuse("actorder", weights["actorder"], "activation-ordered groups are read for GPTQ only")
    group = w.group("group_size", ()) if strategy == "group" else None
    ignore = raw.get("ignore") or []
    if not (isinstance(ignore, list) and all(isinstance(e, str) for e in ignore)):
        raise fields.refuse("ignore", ignore, "a list of module names")
    config = PackedConfig("compressed-tensors", bits, group, sym, ignore=tuple(ignore))
    if not config.ignored("lm_head"):
        raise fields.refuse(
            "ignore", ignore, "minisgl keeps the LM head unquantized: the list must name lm_head"
        )
    _check_all_quantized(fields, "ignore", ignore, config.ignored)  # (a MoE router, mlp.gate, may be)
    return config
