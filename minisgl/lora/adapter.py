"""Reading a PEFT LoRA adapter (a `save_pretrained` folder or a hub id) into host tensors laid out for
minisgl's packed projections and sharded for one tensor-parallel rank.

A module m with A (r, in) and B (out, r) adds scaling * B A x to m's output, scaling = alpha / r
(alpha / sqrt(r) with `use_rslora`), r and alpha per module under `rank_pattern` / `alpha_pattern`.
Targets are q/k/v/o_proj and gate/up/down_proj (a mixture-of-experts model: the attention four), chosen
by `target_modules` (names, a regex, "all-linear"), `layers_to_transform` and `exclude_modules` as PEFT
chooses them. Per layer and packed projection (`minisgl.models.llama.layer_projections`) the adapter
holds A stacked by segment, (n_seg, rank, in_local), and B with the scaling folded in, (out_local,
rank), zero where a module has a smaller rank or no adapter. Column-parallel projections (qkv, gate_up)
keep this rank's rows of B, row-parallel ones (o, down) its columns of A: the model all-reduces their
output, and the ranks' B (A_r x_r) sum to B A x. Everything else is refused with a `LoraError`.

Phi-3 (`fused_checkpoint`) has one module for q/k/v (`qkv_proj`) and one for gate/up (`gate_up_proj`),
as transformers builds it, so PEFT targets those: an adapter on a fused module reads as one on each of
its parts, with the same A, B's rows cut at the parts' sizes, the fused module's r and alpha.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from minisgl.distributed import DistributedInfo
from minisgl.models.config import ModelConfig
from minisgl.models.fp8 import Projection
from minisgl.models.llama import layer_projections

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT keys of the weights: base_model.model.<module name>.lora_A.weight (A) or .lora_B.weight (B)
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")
# parts of a weight's name that say which module it is for, where minisgl serves no LoRA
_UNSERVED_PARTS = (("embed_tokens", "the embedding"), ("lm_head", "the LM head"), ("experts", "MoE experts"))
# adapter_config.json keys minisgl refuses when set (truthy), and why
_REFUSED = {
    "use_dora": "DoRA adds a magnitude vector minisgl does not apply",
    "modules_to_save": "full copies of modules are not served; only LoRA deltas",
    "lora_bias": "LoRA biases are not supported",
    "target_parameters": "LoRA on parameters (e.g. fused MoE experts) is not supported",
    "layer_replication": "replicated layers are not supported",
    "trainable_token_indices": "trained token embeddings are not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not supported",
    "use_qalora": "QA-LoRA is not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
    "fan_in_fan_out": "transposed (Conv1D) weights are not supported",
    "megatron_config": "Megatron-sharded adapters are not supported",
}


class LoraError(ValueError):
    """An adapter minisgl cannot serve; the message names the adapter, the reason and the value."""


@dataclass
class LoraAdapter:
    """One adapter's host tensors for one tensor-parallel rank (see the module docstring).

    `layers[i][p]` is (a, b) of packed projection p of layer i, or None where none of its modules has an
    adapter: a (n_seg, rank, in_local), b (out_local, rank), in `dtype`, pinned when CUDA is available.
    `rank` is the largest module rank, `targets` the modules (of q_proj ... down_proj) with weights."""

    name: str
    path: str
    rank: int
    targets: tuple[str, ...]
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor] | None]]
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for ab in layer.values() if ab for t in ab)


def lora_projections(cfg: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> dict[str, Projection]:
    """This rank's part of each packed projection that takes LoRA: qkv_proj, o_proj, gate_up_proj and
    down_proj; a mixture-of-experts model only its attention two."""
    tp = DistributedInfo(tp_rank, tp_size)
    if cfg.num_experts == 0:
        return layer_projections(cfg, tp)
    projections = layer_projections(dataclasses.replace(cfg, intermediate_size=0), tp)
    return {p: projections[p] for p in ("qkv_proj", "o_proj")}


def supported_modules(cfg: ModelConfig) -> tuple[str, ...]:
    """The modules of a layer that take LoRA, as PEFT names them: q/k/v/o_proj, and gate/up/down_proj
    but in a MoE model (Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj)."""
    return tuple(n.rpartition(".")[2] for n in _peft_parts(cfg))


def _module_names(cfg: ModelConfig) -> list[str]:
    """The names of every module that takes LoRA, as in transformers (model.layers.0.self_attn.q_proj)."""
    return [_full(i, name) for i in range(cfg.num_layers) for name in _peft_parts(cfg)]


def _full(layer: int, name: str) -> str:
    """The full name of module `name` ("self_attn.q_proj") of `layer`."""
    return f"model.layers.{layer}.{name}"


def _peft_parts(cfg: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """The modules of a layer as PEFT sees them ("self_attn.qkv_proj" for Phi-3), each with its parts
    among minisgl's (module name, rows): itself alone where the checkpoint is not fused."""
    modules: dict[str, tuple[tuple[str, int], ...]] = {}
    for key, projection in lora_projections(cfg).items():
        parts = tuple((n, segment.size) for n, segment in zip(projection.names, projection.segments))
        if cfg.fused_checkpoint and len(parts) > 1:
            modules[f"{projection.names[0].rpartition('.')[0]}.{key}"] = parts
        else:
            modules.update({name: ((name, rows),) for name, rows in parts})
    return modules


def load_adapter(
    name: str,
    path: str | Path,
    cfg: ModelConfig,
    *,
    max_rank: int,
    dtype: torch.dtype,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> LoraAdapter:
    """Reads and checks the adapter at `path` (a PEFT folder or a hub id) for `cfg`, converted to `dtype`
    and laid out for rank `tp_rank` of `tp_size` (see the module docstring). Raises `LoraError`."""
    where = f"LoRA adapter {name!r} ({path})"
    folder = _resolve(str(path), where)
    config = _read_config(folder, where)
    modules = supported_modules(cfg)
    targeted = _targeted(config, cfg, where)
    ranks = {key: _pattern_value(config, "rank_pattern", "r", key) for key in targeted}
    worst = max(ranks.items(), key=lambda item: item[1], default=None)
    if worst is not None and worst[1] > max_rank:
        raise LoraError(
            f"{where}: rank r={worst[1]} (of {worst[0]}) is above max_lora_rank={max_rank}; raise the "
            "setting max_lora_rank to serve it"
        )
    weights = _read_weights(folder, cfg, set(targeted), where)
    found = {module_name.rpartition(".")[2] for module_name, _ in weights}
    scalings = {}
    for module, r in ranks.items():
        alpha = _pattern_value(config, "alpha_pattern", "lora_alpha", module)
        scalings[module] = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
    weights, ranks, scalings = _split_fused(cfg, weights, ranks, scalings, where)
    projections = lora_projections(cfg, tp_rank, tp_size)
    rank = max(ranks.values(), default=0)
    layers = [
        {p: _packed(i, proj, weights, ranks, scalings, rank, dtype, where) for p, proj in projections.items()}
        for i in range(cfg.num_layers)
    ]
    return LoraAdapter(
        name, str(path), rank, tuple(m for m in modules if m in found), layers, tp_rank, tp_size
    )


def _split_fused(
    cfg: ModelConfig,
    weights: dict[tuple[str, str], torch.Tensor],
    ranks: dict[str, int],
    scalings: dict[str, float],
    where: str,
) -> tuple[dict[tuple[str, str], torch.Tensor], dict[str, int], dict[str, float]]:
    """Phi-3: each fused module's (A, B), r and scaling as its parts' (the same A, B's rows cut at the
    parts' sizes); the others unchanged."""
    fused = {name: parts for name, parts in _peft_parts(cfg).items() if len(parts) > 1}
    if not fused:
        return weights, ranks, scalings
    weights, ranks, scalings = dict(weights), dict(ranks), dict(scalings)
    for layer in range(cfg.num_layers):
        for name, parts in fused.items():
            module = _full(layer, name)
            if (module, "A") not in weights:
                continue
            lora_a, lora_b = weights.pop((module, "A")), weights.pop((module, "B"))
            r, scaling = ranks.pop(module), scalings.pop(module)
            rows = sum(size for _, size in parts)
            if tuple(lora_b.shape) != (rows, r):
                raise LoraError(
                    f"{where}: {module}.lora_B.weight has shape {list(lora_b.shape)}, expected {[rows, r]} "
                    f"(rank r={r} of {CONFIG_FILE}; the fused module has {rows} rows)"
                )
            start = 0
            for part, size in parts:
                weights[_full(layer, part), "A"] = lora_a
                weights[_full(layer, part), "B"] = lora_b[start : start + size]
                ranks[_full(layer, part)], scalings[_full(layer, part)] = r, scaling
                start += size
    return weights, ranks, scalings


def _resolve(path: str, where: str) -> Path:
    """The adapter's folder: `path` itself, or the hub snapshot of the id `path` (its two files)."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        raise LoraError(f"{where}: not a folder, nor a Hugging Face hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE]))
    except Exception as e:  # noqa: BLE001  (offline, unknown repo, no access: all say the same)
        raise LoraError(
            f"{where}: no such folder, and the Hugging Face hub did not give it ({type(e).__name__}: {e})"
        ) from e


def _read_config(folder: Path, where: str) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise LoraError(f"{where}: no {CONFIG_FILE} in the folder (a PEFT adapter is saved with one)")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoraError(f"{where}: {CONFIG_FILE} is not valid JSON ({e})") from e
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        peft_type = config.get("peft_type") if isinstance(config, dict) else config
        raise LoraError(f"{where}: peft_type={peft_type!r} is not supported; minisgl serves LORA adapters")
    for key, why in _REFUSED.items():
        if config.get(key):
            raise LoraError(f"{where}: {key}={config[key]!r} is not supported ({why})")
    if config.get("bias", "none") != "none":
        raise LoraError(
            f"{where}: bias={config['bias']!r} is not supported (biases are not served); use 'none'"
        )
    for key, pattern, kind in (("r", "rank_pattern", int), ("lora_alpha", "alpha_pattern", int | float)):
        config[pattern] = config.get(pattern) or {}
        if not isinstance(config[pattern], dict):
            raise LoraError(f"{where}: {pattern}={config[pattern]!r} must map module patterns to values")
        for name, value in (("", config.get(key)), *config[pattern].items()):
            if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
                what = f"{pattern}[{name!r}]" if name else key
                number = "integer" if kind is int else "number"
                raise LoraError(f"{where}: {what}={value!r} in {CONFIG_FILE} must be a positive {number}")
    return config


def _targeted(config: dict[str, Any], cfg: ModelConfig, where: str) -> list[str]:
    """The names of the modules PEFT gives an adapter (its `check_target_module_exists`, on the modules
    minisgl serves), after refusing a listed target minisgl does not serve."""
    targets = config.get("target_modules")
    modules = supported_modules(cfg)
    if isinstance(targets, list):
        for target in targets:
            if not isinstance(target, str) or target.rpartition(".")[2] not in modules:
                mlp = ("gate_proj", "up_proj", "down_proj", "gate", "experts")
                moe = cfg.num_experts and str(target).rpartition(".")[2] in mlp
                why = "the MLP of a mixture-of-experts model (experts, router) takes no LoRA; " if moe else ""
                raise LoraError(
                    f"{where}: target_modules includes {target!r}, which {cfg.architecture} has no LoRA "
                    f"on ({why}minisgl serves LoRA on {', '.join(modules)})"
                )
    elif not isinstance(targets, str):
        raise LoraError(f"{where}: target_modules={targets!r} must be a list of names or a regex string")
    names = _module_names(cfg)
    if targets == "all-linear":
        return names
    try:
        return [name for name in names if _peft_targets(config, name)]
    except re.error as e:
        raise LoraError(f"{where}: a pattern of {CONFIG_FILE} is not a valid regex ({e})") from e


def _matches(spec: str | list[str], name: str) -> bool:
    """PEFT's rule: a string is a regex matching the whole name, a list holds names or name suffixes."""
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return name in spec or any(name.endswith(f".{s}") for s in spec)


def _peft_targets(config: dict[str, Any], name: str) -> bool:
    """Whether PEFT's `check_target_module_exists` (peft 0.13 to 0.21) gives module `name` an adapter."""
    if config.get("exclude_modules") and _matches(config["exclude_modules"], name):
        return False
    targets = config["target_modules"]
    if isinstance(targets, str) or name in targets:
        return _matches(targets, name)
    if not _matches(targets, name):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    pattern = config.get("layers_pattern") or None
    patterns = [pattern] if isinstance(pattern, str) else pattern
    found = (
        re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
        if not patterns
        else next((m for p in patterns if (m := re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", name))), None)
    )
    if found is None:
        return False
    index = int(found["idx"])
    return index == layers if isinstance(layers, int) else index in layers


def _pattern_value(config: dict[str, Any], pattern_key: str, default_key: str, name: str) -> float:
    """A module's r or alpha: the first key of `rank_pattern` / `alpha_pattern` that matches the end of
    its name (PEFT's `get_pattern_key`), else the adapter's `r` / `lora_alpha`."""
    for key, value in config[pattern_key].items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return config[default_key]


def _read_weights(
    folder: Path, cfg: ModelConfig, targeted: set[str], where: str
) -> dict[tuple[str, str], torch.Tensor]:
    """(module name, "A" or "B") -> tensor, for every targeted module (both present, nothing else)."""
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        found = [p.name for p in folder.glob("adapter_model.*")]
        hint = f" (found {', '.join(found)}: only safetensors are loaded, never pickles)" if found else ""
        raise LoraError(f"{where}: no {WEIGHTS_FILE} in the folder{hint}")
    weights: dict[tuple[str, str], torch.Tensor] = {}
    with safe_open(file, "pt") as f:
        for key in f.keys():
            match = _KEY.fullmatch(key)
            module = match["module"] if match else None
            if module not in targeted:
                raise LoraError(f"{where}: weight {key!r} {_unserved(key, module, cfg)}")
            assert match is not None
            weights[module, match["ab"]] = f.get_tensor(key)
    missing = sorted({name for name in targeted for ab in "AB" if (name, ab) not in weights})
    if missing:
        raise LoraError(f"{where}: {WEIGHTS_FILE} has no lora_A/lora_B weights for {', '.join(missing[:4])}")
    return weights


def _unserved(key: str, module: str | None, cfg: ModelConfig) -> str:
    """Why a weight maps to no module the adapter may change (completes "weight KEY ...")."""
    served = f"minisgl serves LoRA on {', '.join(supported_modules(cfg))}"
    if module in _module_names(cfg):
        return f"is for {module}, which {CONFIG_FILE}'s target_modules does not target"
    for part, what in _UNSERVED_PARTS:
        if part in key:
            return f"is LoRA on {what} ({part}), which is not supported; {served}"
    if cfg.num_experts and ".mlp." in key:
        return f"is LoRA on the MLP of a mixture-of-experts model, which is not supported; {served}"
    return f"maps to no layer of {cfg.architecture} ({cfg.num_layers} layers) that takes LoRA; {served}"


def _packed(
    layer: int,
    projection: Projection,
    weights: dict[tuple[str, str], torch.Tensor],
    ranks: dict[str, int],
    scalings: dict[str, float],
    rank: int,
    dtype: torch.dtype,
    where: str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a, b) of one packed projection of `layer` on this rank, or None where no module has weights."""
    present = [(i, n, rows) for i, n, rows in projection.row_slices() if (_full(layer, n), "A") in weights]
    if not present:
        return None
    cols = projection.cols
    a = torch.zeros(len(projection.names), rank, cols.size, dtype=dtype)
    b = torch.zeros(projection.rows, rank, dtype=dtype)
    for index, name, rows in present:
        module = _full(layer, name)
        lora_a, lora_b = weights[module, "A"], weights[module, "B"]
        r, segment = ranks[module], projection.segments[index]
        for what, tensor, shape in (
            ("lora_A", lora_a, (r, cols.size * cols.parts)),
            ("lora_B", lora_b, (segment.size * segment.parts, r)),
        ):
            if tuple(tensor.shape) != shape:
                full = (segment.size * segment.parts, cols.size * cols.parts)
                raise LoraError(
                    f"{where}: {module}.{what}.weight has shape {list(tensor.shape)}, expected {list(shape)} "
                    f"(rank r={r} of {CONFIG_FILE}; the model's weight is {list(full)})"
                )
        scaling = scalings[module]
        dim, part, parts = projection.split(index)
        if dim == 0:  # column-parallel: this rank's rows of B
            lora_b = lora_b[part * segment.size : (part + 1) * segment.size]
        else:  # row-parallel: this rank's columns of A
            lora_a = lora_a[:, part * cols.size : (part + 1) * cols.size]
        a[index, :r] = lora_a.to(dtype)
        b[rows, :r] = (lora_b.float() * scaling).to(dtype)
    if torch.cuda.is_available():
        a, b = a.pin_memory(), b.pin_memory()
    return a, b
