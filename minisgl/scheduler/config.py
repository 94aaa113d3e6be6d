"""SchedulerConfig: the scheduler's settings, beside the engine's EngineConfig (as in Mini-SGLang).

Each field is a setting declared once, here (see minisgl.config_fields for the style); minisgl.settings
builds the YAML keys, MINISGL_* variables and CLI options from these fields, one flat set with the
engine's.
"""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.config_fields import check_fields, setting

# prompt tokens per prefill step when max_prefill_tokens is unset, by device type
AUTO_MAX_PREFILL_TOKENS = {"cpu": 512, "cuda": 8192}
CACHE_TYPES = ("radix", "naive")
SPECULATIVE_METHODS = ("none", "ngram", "draft")
POOLING_SETTINGS = ("auto", "last", "mean", "cls")


def _lora_modules(value: object) -> object:
    """`lora_modules` as NAME=PATH strings: from a mapping {NAME: PATH} or a list (or tuple) of
    NAME=PATH; each with a name and a path, no name twice."""
    if isinstance(value, dict):
        value = [f"{name}={path}" for name, path in value.items()]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        return value  # the type check names it
    names: list[str] = []
    for entry in value:
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules={list(value)!r}: {entry!r} must read NAME=PATH")
        if name.strip() in names:
            raise ValueError(f"lora_modules={list(value)!r}: the name {name.strip()!r} is given twice")
        names.append(name.strip())
    return tuple(f"{name}={entry.partition('=')[2].strip()}" for name, entry in zip(names, value))


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler over one engine batches its requests."""

    max_prefill_tokens: int | None = setting(
        None,
        "Prompt tokens per prefill step (the chunked-prefill budget); unset = 512 on CPU, 8192 on CUDA.",
        ge=1,
    )
    overlap_scheduling: bool = setting(
        True,
        "Prepare step N+1 on the host while the device runs step N (also under tensor parallelism); "
        "false (MINISGL_OVERLAP_SCHEDULING=0) for ablation.",
    )

    cache_type: str = setting(
        "radix",
        "Prefix cache: 'radix' keeps finished requests' KV pages in a radix tree and skips the prefill of "
        "any cached prefix (whole pages); 'naive' recomputes every prompt (docs/prefix-cache.md).",
        choices=CACHE_TYPES,
    )

    speculative_method: str = setting(
        "none",
        "Speculative decoding: 'ngram' proposes the tokens that followed the latest earlier occurrence of "
        "the request's last tokens (prompt lookup), 'draft' a smaller model's greedy tokens "
        "(speculative_draft_model); the target verifies them in one forward (docs/speculative.md).",
        choices=SPECULATIVE_METHODS,
    )
    speculative_num_tokens: int = setting(
        4,
        "Draft tokens proposed per request and verify step (k): each step yields 1 to k + 1 tokens.",
        ge=1,
        le=16,
    )
    speculative_draft_model: str | None = setting(
        None,
        "The draft model's folder for speculative_method 'draft' (config.json + *.safetensors, the "
        "target's vocabulary); 'smollm2-135m' = the embedded default model.",
    )
    speculative_ngram_max: int = setting(
        4, "Longest n-gram (of the request's last tokens) that 'ngram' looks up, longest first.", ge=1, le=32
    )

    lora_modules: tuple[str, ...] | None = setting(
        None,
        "LoRA adapters loaded at start, NAME=PATH each (PATH: a PEFT folder, adapter_config.json + "
        "adapter_model.safetensors, or a hub id); a request names its adapter as its model "
        "(docs/lora.md). YAML: a list or a mapping NAME: PATH; env: comma-separated.",
        parse=_lora_modules,
        given_as=list[str] | tuple[str, ...] | dict[str, str] | None,
    )
    allow_runtime_lora: bool = setting(
        False,
        "Allow loading and unloading LoRA adapters while serving: POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter (off: 403). Also gives an engine without lora_modules its adapter slots.",
    )
    pooling: str = setting(
        "auto",
        "Embeddings' pooling (docs/embeddings.md): 'auto' follows the folder's sentence-transformers files "
        "(modules.json, 1_Pooling), else the last token; or 'last', 'mean', 'cls'.",
        choices=POOLING_SETTINGS,
    )
    normalize_embeddings: bool | None = setting(
        None,
        "L2-normalize embeddings; unset = what the folder's modules.json says (a Normalize module), else true.",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.speculative_method == "draft" and not self.speculative_draft_model:
            raise ValueError(
                "speculative_method='draft' needs speculative_draft_model: the draft model's folder "
                "(or 'smollm2-135m'); or use speculative_method='ngram'"
            )

    def lora_module_paths(self) -> dict[str, str]:
        """`lora_modules` as {name: path}, in the order given."""
        return dict(entry.split("=", 1) for entry in self.lora_modules or ())

    def prefill_tokens(self, device_type: str) -> int:
        """``max_prefill_tokens``, or where unset, the default of ``device_type`` ('cpu' or 'cuda')."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        return AUTO_MAX_PREFILL_TOKENS.get(device_type, AUTO_MAX_PREFILL_TOKENS["cpu"])
