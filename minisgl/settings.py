"""EngineSettings: the user-facing, layered settings that build the frozen configs.

The settings are the ``setting(...)`` fields of EngineConfig, SchedulerConfig and LaunchConfig, one flat
set of keys layered explicit > ``MINISGL_*`` env > YAML file > defaults; nothing here lists them again.
Adding a setting, layers and errors: docs/architecture.md#settings-and-configs; the keys: docs/settings.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import torch
import yaml
from pydantic import AfterValidator, BeforeValidator, Field, PrivateAttr, ValidationError, create_model
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from minisgl.config_fields import (
    SettingField,
    as_tuple,
    check_fields,
    describe_type,
    is_instance,
    setting,
    settings_of,
)
from minisgl.distributed import DistributedInfo
from minisgl.engine.config import EngineConfig
from minisgl.multimodal.config import MediaConfig
from minisgl.scheduler.config import SchedulerConfig

ENV_PREFIX = "MINISGL_"
CONFIG_ENV_VAR = "MINISGL_CONFIG"
# MINISGL_* variables that are read elsewhere and are not settings
NON_SETTING_ENV_VARS = frozenset({CONFIG_ENV_VAR, "MINISGL_CACHE_DIR"})
# an environment variable holding this string sets an optional setting to None
ENV_NONE = "none"

# settings holding a path that a YAML file may give relative to its own folder
RELATIVE_PATHS = ("model_path", "chat_template")

EXPLICIT = "explicit"
DEFAULT = "default"

C = TypeVar("C")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How many processes run the engine: the launcher's settings, not one engine's."""

    tp_size: int = setting(
        1, "Tensor-parallel size: number of ranks, one GPU each (each rank's EngineConfig.tp_info).", ge=1
    )
    dp_size: int = setting(
        1,
        "Data-parallel replicas of `minisgl-run serve`: N scheduler processes (each an engine, or a group "
        "of tp_size ranks) behind one front end; replica i on GPUs i*tp_size..(i+1)*tp_size-1.",
        ge=1,
    )

    def __post_init__(self) -> None:
        check_fields(self)


SECRET_SETTINGS = frozenset({"api_key"})  # never printed (`minisgl-run config`, logs)


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # minisgl.server.tool_parsers.FORMATS


def _template_file(path: str) -> None:
    if not Path(path).is_file():
        raise ValueError(f"chat_template={path!r} is not a file (give a Jinja chat template file)")


def _names(description: str) -> Any:
    """A setting holding a list of names, unset by default ('a,b' or [a, b] given)."""
    return setting(None, description, parse=as_tuple, given_as=list[str] | None)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Where the OpenAI-compatible server (`minisgl-run serve`, minisgl.server) listens and how it
    bounds its work: the launcher's settings, read by the server's front end."""

    host: str = setting(
        "127.0.0.1",
        "Address `minisgl-run serve` binds to; 127.0.0.1 (loopback) unless told otherwise, e.g. 0.0.0.0.",
    )
    port: int = setting(30000, "TCP port of `minisgl-run serve` (HTTP API and /metrics).", ge=1, le=65535)
    served_model_name: str | None = setting(
        None, "Model name the server answers to (/v1/models, the `model` field); unset = the folder's name."
    )
    api_key: str | None = setting(
        None,
        "Require `Authorization: Bearer KEY` on every route but /health and /metrics (401 otherwise); "
        "unset = no key. Never printed.",
    )
    max_waiting_requests: int = setting(
        1024,
        "Requests the server queues beyond max_running_req; past it new requests get 503 with Retry-After.",
        ge=0,
    )
    shutdown_grace_s: float = setting(
        30.0,
        "On SIGINT/SIGTERM, seconds the server lets running requests finish before aborting them.",
        ge=0,
    )
    engine_restart: bool = setting(
        True,
        "When the engine (scheduler) process of a running server dies, start it again after a back-off "
        "(1, 2, 4 ... 30 s) while the server answers 503 `engine_restarting`; after engine_restart_limit "
        "deaths (a crash loop) the server stays up answering 503 with the last cause; false = the server "
        "exits 1, for an outside supervisor to restart it. An engine that never started ends it either way.",
    )
    engine_restart_limit: int = setting(
        5, "Deaths of one engine within engine_restart_window_s that end its restarts (a crash loop).", ge=1
    )
    engine_restart_window_s: float = setting(
        600.0, "The window, in seconds, over which engine_restart_limit counts an engine's deaths.", gt=0
    )
    max_request_bytes: int = setting(
        8 << 20, "Largest request body the server reads, in bytes (413 past it).", ge=1024
    )
    tokenizer_workers: int | None = setting(
        None,
        "Processes that tokenize prompts in parallel (chat template and tokenizer); 1 = one thread of "
        "the front end; unset = a quarter of the CPUs, 1 to 4.",
        ge=1,
    )
    max_connections: int = setting(
        2048,
        "Open HTTP connections the server keeps (lowered to what the open-file limit allows); at the cap "
        "a new one closes the oldest idle one, or is answered 503 when every one has a request in flight.",
        ge=1,
    )
    idle_timeout_s: float = setting(
        5.0, "Seconds a connection may stay open sending nothing (before or between requests).", gt=0
    )
    header_timeout_s: float = setting(
        10.0,
        "Seconds a request's line and headers may take to arrive from their first byte (408 past it).",
        gt=0,
    )
    body_timeout_s: float = setting(
        60.0, "Seconds a request's body may take to arrive after its headers (408 past it).", gt=0
    )
    send_timeout_s: float = setting(
        60.0, "Seconds a response may wait on a client that reads nothing (the connection is closed).", gt=0
    )
    allowed_hosts: tuple[str, ...] | None = _names(
        "Host header values the server answers (e.g. [myhost, myhost.lan], '*' for any); unset = the "
        "loopback names when bound to loopback, any otherwise."
    )
    cors_allow_origins: tuple[str, ...] | None = _names(
        "Web origins allowed to call the API from a browser (CORS), e.g. [http://localhost:3000]; unset = "
        "none: a request with another Origin gets 403."
    )
    max_stop_strings: int = setting(32, "Stop strings one request may give (400 past it).", ge=1)
    max_stop_string_length: int = setting(
        256, "Characters of the longest stop string a request may give.", ge=1
    )
    request_trace: str | None = setting(
        None,
        "JSON-lines file the server appends one line to per finished request: its stage times "
        "(docs/server.md#request-traces); unset = none.",
    )
    chat_template: str | None = setting(
        None,
        "Jinja chat template file the server renders chats with instead of the model's (e.g. "
        "configs/templates/hermes-tools.jinja, which renders tools: docs/tools.md); unset = the model's.",
        check=_template_file,
    )
    tool_call_parser: str | None = setting(
        None,
        "How the server reads tool calls in replies (tool_choice auto): hermes, llama3_json or mistral "
        "(docs/tools.md); unset = auto refused, forced calls in hermes's format.",
        choices=TOOL_CALL_PARSERS,
    )

    def __post_init__(self) -> None:
        check_fields(self)


# the configs whose setting fields make the settings, in the order the settings are listed
CONFIGS: tuple[type, ...] = (EngineConfig, SchedulerConfig, LaunchConfig, ServerConfig, MediaConfig)


def setting_fields() -> dict[str, SettingField]:
    """Every setting of every config in :data:`CONFIGS`, by key; a key declared twice is an error."""
    fields: dict[str, SettingField] = {}
    for config_cls in CONFIGS:
        for field in settings_of(config_cls):
            if field.name in fields:
                other = fields[field.name].owner.__name__
                raise TypeError(
                    f"setting {field.name!r} is declared in both {other} and {config_cls.__name__}"
                )
            fields[field.name] = field
    return fields


class _InlineListDumper(yaml.SafeDumper):
    """SafeDumper that writes lists inline ([1, 2, 4]), so each setting takes one line."""


_InlineListDumper.add_representer(
    list, lambda dumper, value: dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=True)
)


class SettingsError(ValueError):
    """Invalid settings; the message names each bad key, its value and where it came from."""


class _Settings(BaseSettings):
    """The methods of :class:`EngineSettings`; its fields are generated from the configs' fields."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

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
            raise SettingsError(_describe_errors(e, values, origins, list(type(self).model_fields))) from None
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
        values = self.model_dump(mode="json")
        for name in SECRET_SETTINGS:  # a key is never printed: only whether one is set
            if values.get(name) is not None:
                values[name] = "<set>"
        text = yaml.dump(
            values,
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

    # -- the configs -------------------------------------------------------------------------------

    def resolved_model_path(self) -> str:
        """``model_path``, with unset or the default-model alias replaced by the default model's folder."""
        from minisgl.models.default import DEFAULT_MODEL_ALIAS, default_model_path

        if self.model_path is None or self.model_path == DEFAULT_MODEL_ALIAS:
            return os.fspath(default_model_path())
        return self.model_path

    def build(self, config_cls: type[C], **values: Any) -> C:
        """The config ``config_cls`` from its own setting fields; ``values``: its other fields, and the
        values the settings layer fills. Its errors also name where the named keys came from."""
        kwargs = {field.name: getattr(self, field.name) for field in settings_of(config_cls)}
        try:
            return config_cls(**{**kwargs, **values})
        except (ValueError, TypeError, FileNotFoundError) as e:
            # the configs' messages read "key=value ..."; add where the named keys came from
            origins = self.sources()
            named = [f"{name} from {origins[name]}" for name in origins if f"{name}=" in str(e)]
            if not named:
                raise
            raise type(e)(f"{e} ({'; '.join(named)})") from e

    def to_engine_config(self, rank: int = 0) -> EngineConfig:
        """The frozen :class:`EngineConfig` of tensor-parallel rank ``rank``."""
        tp_info = DistributedInfo(rank=rank, size=self.tp_size)
        lora = bool(self.lora_modules) or self.allow_runtime_lora  # the engine keeps adapter slots
        return self.build(
            EngineConfig, model_path=self.resolved_model_path(), tp_info=tp_info, enable_lora=lora
        )

    def to_scheduler_config(self) -> SchedulerConfig:
        """The frozen :class:`SchedulerConfig`."""
        config = self.build(SchedulerConfig)
        if config.speculative_method != "none" and self.tp_size > 1:  # the one setting it depends on
            origins = self.sources()
            raise ValueError(
                f"speculative_method={config.speculative_method!r} is not supported under tensor parallelism "
                f"yet (tp_size={self.tp_size}): leave speculative_method at 'none' or use tp_size 1 "
                f"(speculative_method from {origins['speculative_method']}; tp_size from {origins['tp_size']})"
            )
        return config

    def to_server_config(self) -> ServerConfig:
        """The frozen :class:`ServerConfig`."""
        return self.build(ServerConfig)

    def to_media_config(self) -> MediaConfig:
        """The frozen :class:`MediaConfig` (image inputs)."""
        return self.build(MediaConfig)


# -- the pydantic model, generated from the configs' fields -----------------------------------------


def _parse_list(value: Any) -> Any:
    """A list, a JSON list '[1,2,4]' or a comma-separated '1,2,4' (as env variables and options give)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() in ("", ENV_NONE, "null"):
        return None
    if text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{value!r} is not a JSON list: {e}") from None
    return [part.strip() for part in text.split(",")]


def _checker(field: SettingField) -> Callable[[Any], Any]:
    """Checks a parsed value with the field's own declaration; the settings keep the plain value."""

    def check(value: Any) -> Any:
        if value is None and field.required:  # unset: the settings layer fills it (model_path)
            return value
        try:
            field.validate(value)
        except TypeError as e:  # pydantic reports ValueErrors
            raise ValueError(str(e)) from None
        return value

    return check


def _holds_list(annotation: Any) -> bool:
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return any(typing.get_origin(arg) is list for arg in args)


def _reader(field: SettingField) -> Callable[[Any], Any]:
    """A string (env variables, CLI options) is parsed into the setting's type; any other value (Python,
    YAML) must have that type already: True is no 1, 1 is no True. Where the config holds a torch.dtype
    given by name, a torch.dtype from Python (``LLM(dtype=torch.float16)``) becomes its name ('float16'):
    the settings keep the string."""
    holds_list = _holds_list(field.given_type)
    dtype_by_name = is_instance(torch.float32, field.annotation) and is_instance("", field.given_type)

    def read(value: Any) -> Any:
        if dtype_by_name and isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        if isinstance(value, str):
            return _parse_list(value) if holds_list else value
        if not is_instance(value, field.given_type):
            raise ValueError(f"{field.name}={value!r} must be {describe_type(field.given_type)}")
        return value

    return read


def _pydantic_field(field: SettingField) -> tuple[Any, Any]:
    # the env source does not decode lists as JSON (NoDecode): _reader parses them
    metadata = [NoDecode, BeforeValidator(_reader(field)), AfterValidator(_checker(field))]
    default = None if field.required else field.default
    return Annotated[(field.given_type, *metadata)], Field(default=default, description=field.description)


EngineSettings = create_model(
    "EngineSettings",
    __base__=_Settings,
    __module__=__name__,
    __doc__="""Every setting in plain types, layered explicit > ``MINISGL_*`` env > YAML file > defaults.

    Build with :meth:`load` (or the constructor, which takes the same explicit keyword arguments and
    reads the YAML file named by ``MINISGL_CONFIG``), then call :meth:`to_engine_config` and
    :meth:`to_scheduler_config`. The fields are those of the configs in :data:`CONFIGS`.
    """,
    **{name: _pydantic_field(field) for name, field in setting_fields().items()},
)


# -- layers ----------------------------------------------------------------------------------------


def _collect_layers(
    settings_cls: type[_Settings], config: str | os.PathLike[str] | None, explicit: Mapping[str, Any]
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


def _read_env(settings_cls: type[_Settings]) -> dict[str, tuple[str, Any]]:
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

    A relative ``model_path`` or ``chat_template`` is resolved against the file's folder when that
    resolved path exists.
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
    for key in RELATIVE_PATHS:
        value = data.get(key)
        if isinstance(value, str) and value and not Path(value).is_absolute():
            beside = file.parent / value
            if beside.exists():
                data[key] = os.fspath(beside.resolve())
    return data


def _describe_errors(
    error: ValidationError, values: Mapping[str, Any], origins: Mapping[str, str], valid: list[str]
) -> str:
    """One line per problem: key=value (from origin): what is wrong; ``valid``: the keys."""
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


# -- docs/settings.md ------------------------------------------------------------------------------

_MARKDOWN_HEAD = """\
<!-- Generated by `python -m minisgl.settings --markdown > docs/settings.md` from the fields of the
configs: edit their declarations, not this file. tests/test_settings.py checks that it is current. -->

# Settings

Every setting is one field of the config that reads it: `EngineConfig` (one engine, one
tensor-parallel rank), `SchedulerConfig` (the scheduler over it) or `LaunchConfig` (how many ranks run),
declared once with its type, default, description and bounds (`minisgl/config_fields.py` describes the
style). The keys form one flat set, and each is spelled four ways: `key: value` in a YAML file, the
environment variable `MINISGL_KEY`, the option `--key` of `minisgl-run` (dashes for underscores; `--model`,
`--tp` and `--dp` are short for `--model-path`, `--tp-size` and `--dp-size`), and the keyword `LLM(key=...)`.

`minisgl.settings.EngineSettings` layers them: explicit values (`LLM` keywords, `minisgl-run` options,
`EngineSettings.load(**values)`) > `MINISGL_*` environment variables > a YAML file (`--config`,
`LLM(config=...)`, `EngineSettings.load(path)`, or named by `MINISGL_CONFIG`) > defaults. YAML is read
with `yaml.safe_load`; a relative `model_path` or `chat_template` in it is resolved against the file's
folder. A variable set to `none` unsets an optional setting; a list is given as `[1, 2, 4]` or `1,2,4`.

Unknown keys (also unknown `MINISGL_*` variables), wrong types and out-of-range values are errors that
name the key, the value, where it came from and, for an unknown key, the nearest valid one.
`minisgl-run config` prints the effective settings with their origins (`settings.to_yaml(with_sources=True)`,
`settings.sources()`); `settings.to_engine_config(rank)` and `settings.to_scheduler_config()` build the
configs. `EngineConfig(...)` built directly is checked by the same declarations.

The presets in `configs/` are such YAML files. `MINISGL_CACHE_DIR` (the default model's cache) is a
`MINISGL_*` variable but no setting.
"""


def _markdown_value(value: Any) -> str:
    if value is None or value is dataclasses.MISSING:
        return "unset"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def settings_markdown() -> str:
    """docs/settings.md: a table of the settings of each config, from the fields' declarations."""
    lines = [_MARKDOWN_HEAD]
    for config_cls in CONFIGS:
        summary = (config_cls.__doc__ or "").strip().splitlines()[0]
        lines += [f"## {config_cls.__name__}", "", f"`{config_cls.__module__}`: {summary}", ""]
        lines += ["| key | environment | default | values | meaning |", "|---|---|---|---|---|"]
        for field in settings_of(config_cls):
            cells = [f"`{field.name}`", f"`{ENV_PREFIX}{field.name.upper()}`", _markdown_value(field.default)]
            cells += [field.values_text(), field.description]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m minisgl.settings``: the effective settings as YAML, or ``--markdown``: docs/settings.md."""
    parser = argparse.ArgumentParser(prog="python -m minisgl.settings", description=main.__doc__)
    parser.add_argument("--markdown", action="store_true", help="print docs/settings.md")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(settings_markdown())
    else:
        sys.stdout.write(EngineSettings.load().to_yaml(with_sources=True))


if __name__ == "__main__":
    from minisgl.settings import main as _main  # the module itself, not this __main__ copy of it

    _main()
