"""EngineSettings: the user-facing, layered settings that build the frozen :class:`EngineConfig`.

Values come from four layers; the first layer that sets a key wins:

1. explicit values: keyword arguments of ``EngineSettings(...)`` / ``EngineSettings.load(...)``
2. ``MINISGL_*`` environment variables, e.g. ``MINISGL_PAGE_SIZE=32``
3. a YAML file, given to ``load(config=...)`` or named by ``MINISGL_CONFIG``
4. the defaults, which equal :class:`EngineConfig`'s defaults

Every effective value remembers which layer it came from (:meth:`EngineSettings.sources`), and every
error names the key, the bad value and, where known, the layer it came from.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import torch
import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from minisgl.distributed import DistributedInfo
from minisgl.engine.config import (
    MAX_PAGE_SIZE,
    MOE_BACKENDS,
    EngineConfig,
    parse_attention_backend,
    parse_dtype,
)

ENV_PREFIX = "MINISGL_"
CONFIG_ENV_VAR = "MINISGL_CONFIG"
# MINISGL_* variables that are read elsewhere and are not settings
NON_SETTING_ENV_VARS = frozenset({CONFIG_ENV_VAR, "MINISGL_CACHE_DIR"})
# an environment variable holding this string sets an optional setting to None
ENV_NONE = "none"
DEVICE_TYPES = ("cpu", "cuda")

EXPLICIT = "explicit"
DEFAULT = "default"


class _InlineListDumper(yaml.SafeDumper):
    """SafeDumper that writes lists inline ([1, 2, 4]), so each setting takes one line."""


_InlineListDumper.add_representer(
    list, lambda dumper, value: dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=True)
)


class SettingsError(ValueError):
    """Invalid settings; the message names each bad key, its value and where it came from."""


class EngineSettings(BaseSettings):
    """Engine settings in plain types, layered explicit > ``MINISGL_*`` env > YAML file > defaults.

    Build with :meth:`load` (or the constructor, which takes the same explicit keyword arguments and
    reads the YAML file named by ``MINISGL_CONFIG``), then call :meth:`to_engine_config`.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    model_path: str | None = Field(
        default=None,
        min_length=1,
        description="Local model folder (config.json + *.safetensors); unset or 'smollm2-135m' = the embedded default model.",
    )
    dtype: str = Field(
        default="auto", description="Weight and activation dtype: auto, float32, bfloat16 or float16."
    )
    device: str = Field(default="auto", description="Device: auto (CUDA when present), cpu, cuda or cuda:N.")
    tp_size: int = Field(default=1, ge=1, description="Tensor-parallel size: number of ranks, one GPU each.")
    page_size: int = Field(
        default=16, ge=1, le=MAX_PAGE_SIZE, description=f"Tokens per KV-cache page (1 to {MAX_PAGE_SIZE})."
    )
    max_running_req: int = Field(
        default=256, ge=1, description="Most requests decoded together in one batch."
    )
    attention_backend: str = Field(
        default="auto",
        description="Attention backend: auto, torch, fi, fa, trtllm, or a 'prefill,decode' pair.",
    )
    moe_backend: str = Field(default="auto", description="Mixture-of-experts backend: auto, torch or fused.")
    cuda_graph_bs: Annotated[list[Annotated[int, Field(ge=1)]] | None, NoDecode] = Field(
        default=None, description="Batch sizes to capture CUDA graphs for, e.g. [1, 2, 4]; unset = automatic."
    )
    cuda_graph_max_bs: int | None = Field(
        default=None,
        ge=0,
        description="Largest batch size to capture a CUDA graph for; 0 disables CUDA graphs.",
    )
    memory_ratio: float = Field(
        default=0.9, gt=0.0, le=1.0, description="Fraction of GPU memory the engine may use, in (0, 1]."
    )
    num_page_override: int | None = Field(
        default=None, ge=1, description="Fixed number of KV-cache pages instead of sizing from free memory."
    )
    max_seq_len_override: int | None = Field(
        default=None,
        ge=1,
        description="Longest sequence (prompt + output); unset = the model's max positions.",
    )
    use_dummy_weight: bool = Field(
        default=False, description="Random weights instead of loading checkpoints (only config.json needed)."
    )
    distributed_addr: str = Field(
        default="tcp://127.0.0.1:23333",
        description="Rendezvous address of the tensor-parallel process group.",
    )
    distributed_timeout: float = Field(
        default=300.0, gt=0.0, description="Timeout in seconds for tensor-parallel collectives."
    )
    overlap_scheduling: bool = Field(
        default=True,
        description="Prepare step N+1 on the host while the device runs step N; false (MINISGL_OVERLAP_SCHEDULING=0) for ablation.",
    )
    batch_invariant: bool = Field(
        default=False,
        description="Give a request the same logits alone or in any batch (GPU: no one-row GEMV kernel, eager prefill); slower.",
    )
    cpu_kv_budget_gib: float | None = Field(
        default=None, gt=0.0, description="KV-cache budget in GiB on CPU; unset = 10% of available RAM."
    )
    # ablation switches (EngineConfig's last block)
    compile_sampler: bool = Field(default=True, description="CUDA: run the sampler compiled; false: eagerly.")
    compile_prefill: bool = Field(default=True, description="CUDA: run prefill compiled; false: eagerly.")
    use_gemv_kernel: bool = Field(default=True, description="CUDA: one-row linear layers on the GEMV kernel.")
    use_kv_store_kernel: bool = Field(default=True, description="CUDA: store K and V with one Triton kernel.")
    tensor_core_min_group: int = Field(
        default=1, ge=1, description="Query heads per KV head from which `fi` decode uses tensor cores."
    )

    # field name -> origin ("explicit", "env MINISGL_X", "yaml <path>", "default")
    _origins: dict[str, str] = PrivateAttr(default_factory=dict)

    def __init__(self, _config: str | os.PathLike[str] | None = None, **explicit: Any) -> None:
        """Explicit keyword values over ``MINISGL_*`` env over the YAML file (``_config`` or ``MINISGL_CONFIG``)."""
        layers = _collect_layers(type(self), _config, explicit)
        values: dict[str, Any] = {}
        origins: dict[str, str] = {}
        for origin, layer in reversed(layers):  # lowest priority first, so higher layers overwrite
            values.update(layer)
            origins.update(dict.fromkeys(layer, origin))
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise SettingsError(_describe_errors(e, values, origins)) from None
        self._origins = {name: origins.get(name, DEFAULT) for name in type(self).model_fields}

    @classmethod
    def load(cls, config: str | os.PathLike[str] | None = None, **explicit: Any) -> EngineSettings:
        """Layers ``explicit`` over ``MINISGL_*`` env over the YAML file ``config`` (default: ``$MINISGL_CONFIG``)."""
        return cls(config, **explicit)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The layers are merged in __init__ (so each value's origin is known); pydantic-settings only
        # receives the merged values as init arguments.
        return (init_settings,)

    # -- validation --------------------------------------------------------------------------------

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        parse_dtype(value)
        return value

    @field_validator("attention_backend")
    @classmethod
    def _check_attention_backend(cls, value: str) -> str:
        parse_attention_backend(value)
        return value

    @field_validator("moe_backend")
    @classmethod
    def _check_moe_backend(cls, value: str) -> str:
        if value not in MOE_BACKENDS:
            raise ValueError(f"moe_backend={value!r} is not valid: use one of {', '.join(MOE_BACKENDS)}")
        return value

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if value == "auto":
            return value
        try:
            device_type = torch.device(value).type
        except RuntimeError:
            device_type = None
        if device_type not in DEVICE_TYPES:
            raise ValueError(f"device={value!r} is not valid: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
        return value

    @field_validator("cuda_graph_bs", mode="before")
    @classmethod
    def _parse_batch_sizes(cls, value: Any) -> Any:
        """Accepts a list, a JSON list '[1,2,4]' or a comma-separated '1,2,4' (as env variables give)."""
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.lower() in ("", ENV_NONE, "null"):
            return None
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"cuda_graph_bs={value!r} is not a JSON list: {e}") from None
        return [part.strip() for part in text.split(",")]

    # -- views -------------------------------------------------------------------------------------

    def sources(self) -> dict[str, str]:
        """Where each effective value came from: 'explicit', 'env MINISGL_X', 'yaml <path>' or 'default'."""
        return {
            name: self._origins.get(name, EXPLICIT if name in self.model_fields_set else DEFAULT)
            for name in type(self).model_fields
        }

    def to_yaml(self, with_sources: bool = False) -> str:
        """The effective settings as YAML, loadable back with :meth:`load`; optionally each line's origin."""
        # block style at the top, lists inline: one line per setting
        text = yaml.dump(
            self.model_dump(mode="json"),
            Dumper=_InlineListDumper,
            sort_keys=False,
            default_flow_style=False,
            width=2**30,
        )
        if not with_sources:
            return text
        origins = self.sources()
        lines = []
        for line in text.splitlines():
            name = line.partition(":")[0]
            lines.append(f"{line}  # {origins[name]}" if name in origins else line)
        return "\n".join(lines) + "\n"

    @classmethod
    def env_var(cls, name: str) -> str:
        """The environment variable that sets setting ``name``, e.g. 'MINISGL_PAGE_SIZE'."""
        return ENV_PREFIX + name.upper()

    # -- EngineConfig ------------------------------------------------------------------------------

    def resolved_model_path(self) -> str:
        """``model_path``, with unset or the default-model alias replaced by the default model's folder."""
        from minisgl.models.default import DEFAULT_MODEL_ALIAS, default_model_path

        if self.model_path is None or self.model_path == DEFAULT_MODEL_ALIAS:
            return os.fspath(default_model_path())
        return self.model_path

    def to_engine_config(self, rank: int = 0) -> EngineConfig:
        """The frozen :class:`EngineConfig` of tensor-parallel rank ``rank``."""
        try:
            return EngineConfig(
                model_path=self.resolved_model_path(),
                dtype=parse_dtype(self.dtype),
                tp_info=DistributedInfo(rank=rank, size=self.tp_size),
                page_size=self.page_size,
                max_running_req=self.max_running_req,
                attention_backend=self.attention_backend,
                moe_backend=self.moe_backend,
                cuda_graph_bs=None if self.cuda_graph_bs is None else tuple(self.cuda_graph_bs),
                cuda_graph_max_bs=self.cuda_graph_max_bs,
                memory_ratio=self.memory_ratio,
                num_page_override=self.num_page_override,
                max_seq_len_override=self.max_seq_len_override,
                use_dummy_weight=self.use_dummy_weight,
                distributed_addr=self.distributed_addr,
                distributed_timeout=self.distributed_timeout,
                device=self.device,
                cpu_kv_budget_gib=self.cpu_kv_budget_gib,
                overlap_scheduling=self.overlap_scheduling,
                batch_invariant=self.batch_invariant,
                compile_sampler=self.compile_sampler,
                compile_prefill=self.compile_prefill,
                use_gemv_kernel=self.use_gemv_kernel,
                use_kv_store_kernel=self.use_kv_store_kernel,
                tensor_core_min_group=self.tensor_core_min_group,
            )
        except (ValueError, TypeError, FileNotFoundError) as e:
            # EngineConfig's messages read "key=value ..."; add where the named keys came from
            origins = self.sources()
            named = [f"{name} from {origins[name]}" for name in origins if f"{name}=" in str(e)]
            if not named:
                raise
            raise type(e)(f"{e} ({'; '.join(named)})") from e


# -- layers ----------------------------------------------------------------------------------------


def _collect_layers(
    settings_cls: type[EngineSettings], config: str | os.PathLike[str] | None, explicit: Mapping[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """The non-default layers, highest priority first, each as (origin, {key: value})."""
    layers: list[tuple[str, dict[str, Any]]] = [(EXPLICIT, dict(explicit))]
    for name, (env_name, value) in _read_env(settings_cls).items():
        layers.append((f"env {env_name}", {name: value}))
    from_env = config is None or os.fspath(config) == ""
    path = os.environ.get(CONFIG_ENV_VAR, "") if from_env else os.fspath(config)
    if path:
        yaml_origin = f"yaml {path}"
        layers.append((yaml_origin, read_yaml(path, named_by=CONFIG_ENV_VAR if from_env else None)))
    return layers


def _read_env(settings_cls: type[EngineSettings]) -> dict[str, tuple[str, Any]]:
    """Setting name -> (environment variable, value) for every ``MINISGL_*`` variable that is set.

    An unknown ``MINISGL_*`` variable (a typo such as MINISGL_PAGESIZE) is an error.
    """
    fields = settings_cls.model_fields
    names: dict[str, str] = {}  # setting name -> the variable as spelled in the environment
    unknown: list[str] = []
    for env_name in sorted(os.environ):
        upper = env_name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in NON_SETTING_ENV_VARS:
            continue
        name = upper[len(ENV_PREFIX) :].lower()
        if name in fields:
            names[name] = env_name
        else:
            unknown.append(env_name)
    if unknown:
        valid = [settings_cls.env_var(name) for name in fields]
        problems = []
        for env_name in unknown:
            hint = difflib.get_close_matches(env_name.upper(), valid, n=1)
            suggestion = f" (did you mean {hint[0]}?)" if hint else ""
            problems.append(f"  {env_name}={os.environ[env_name]!r}{suggestion}")
        raise SettingsError(
            "unknown minisgl environment variable(s):\n"
            + "\n".join(problems)
            + f"\nvalid settings variables: {', '.join(valid)}"
            + f"\nother minisgl variables: {', '.join(sorted(NON_SETTING_ENV_VARS))}"
        )
    # pydantic-settings reads the values: case handling and 'none' -> None for optional settings
    values = EnvSettingsSource(settings_cls, env_parse_none_str=ENV_NONE)()
    return {name: (names[name], value) for name, value in values.items() if name in names}


def read_yaml(path: str | os.PathLike[str], named_by: str | None = None) -> dict[str, Any]:
    """Reads a settings YAML file (with ``yaml.safe_load``) into {key: value}.

    A relative ``model_path`` is resolved against the file's folder when that resolved path exists.
    ``named_by`` is the environment variable that named the file, for the error messages.
    """
    file = Path(path)
    via = f" (named by {named_by})" if named_by else ""
    if not file.is_file():
        what = "is not a file" if file.exists() else "does not exist"
        raise FileNotFoundError(f"settings file {os.fspath(path)!r}{via} {what}")
    try:
        with open(file, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise SettingsError(f"settings file {os.fspath(path)!r}{via} is not valid YAML: {e}") from None
    if data is None:  # an empty file sets nothing
        return {}
    if not isinstance(data, dict):
        raise SettingsError(
            f"settings file {os.fspath(path)!r}{via} must hold a mapping of 'setting: value' at its top "
            f"level, got a {type(data).__name__}"
        )
    bad_keys = [key for key in data if not isinstance(key, str)]
    if bad_keys:
        raise SettingsError(
            f"settings file {os.fspath(path)!r}{via}: keys must be setting names, got {bad_keys!r}"
        )
    model_path = data.get("model_path")
    if isinstance(model_path, str) and model_path and not Path(model_path).is_absolute():
        beside = file.parent / model_path
        if beside.exists():
            data["model_path"] = os.fspath(beside.resolve())
    return data


def _describe_errors(error: ValidationError, values: Mapping[str, Any], origins: Mapping[str, str]) -> str:
    """One line per problem: key=value (from origin): what is wrong."""
    valid = list(EngineSettings.model_fields)
    lines = []
    for item in error.errors():
        loc = item["loc"]
        key = str(loc[0]) if loc else "?"
        where = f" (from {origins[key]})" if key in origins else ""
        shown = f"{key}={values[key]!r}" if key in values else key
        if item["type"] == "extra_forbidden":
            hint = difflib.get_close_matches(key, valid, n=1)
            suggestion = f"did you mean {hint[0]!r}? " if hint else ""
            lines.append(f"  {shown}{where}: unknown setting; {suggestion}valid settings: {', '.join(valid)}")
            continue
        message = item["msg"].removeprefix("Value error, ")
        inner = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc[1:])
        if inner:
            message = f"{key}{inner}={item['input']!r}: {message}"
        if message.startswith(f"{key}={values.get(key)!r}"):  # the message already shows key=value
            lines.append(f"  {message}{where}")
        else:
            lines.append(f"  {shown}{where}: {message}")
    count = len(lines)
    return f"{count} invalid minisgl setting{'s' if count > 1 else ''}:\n" + "\n".join(lines)
