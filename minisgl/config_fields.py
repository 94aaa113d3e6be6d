"""Each setting declared once: a field of the config dataclass that reads it, with description and bounds.

`setting(...)` declares a field from which the YAML key, the ``MINISGL_*`` variable, the CLI flag, the
``LLM(key=...)`` keyword, the checks and docs/settings.md are generated; `internal(...)` declares a field
that is no setting; `check_fields` checks a config (docs/architecture.md, "Settings and configs").
Defaults are written as a user writes them in YAML (``"auto"``, not ``None``); a bool is no integer, an
integer is a number. Errors read ``key=value ...`` so the settings layer can add where the value came
from. This module imports nothing from minisgl: every layer may use it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

_SETTING = "minisgl.setting"
_INTERNAL = "minisgl.internal"


@dataclasses.dataclass(frozen=True)
class Setting:
    """What :func:`setting` records in a field's metadata."""

    description: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], object] | None = None
    parse: Callable[[Any], Any] | None = None
    given_as: Any = None

    def validate(self, name: str, value: Any, annotation: Any) -> Any:
        """The field's value made of ``value`` (by ``parse``); raises TypeError or ValueError naming
        ``name=value`` and what is valid."""
        given = value
        if self.parse is not None:
            value = self.parse(value)
        if not is_instance(value, annotation):
            raise TypeError(f"{name}={given!r} must be {describe_type(annotation)}")
        if value is None:
            return value
        bounds = bounds_text(self.ge, self.gt, self.le, self.lt)
        items = value if isinstance(value, tuple | list) else (value,)
        if any(isinstance(item, float) and not math.isfinite(item) for item in items):
            raise ValueError(f"{name}={given!r} must be a finite number")
        if bounds and not all(_within(item, self.ge, self.gt, self.le, self.lt) for item in items):
            what = "has an entry out of range: each" if items is value else "is out of range: it"
            raise ValueError(f"{name}={given!r} {what} must be {bounds}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{name}={given!r} is not valid: use one of {', '.join(self.choices)}")
        if self.check is not None:
            self.check(value)
        return value


def setting(
    default: Any = dataclasses.MISSING,
    description: str = "",
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Sequence[str] | None = None,
    check: Callable[[Any], object] | None = None,
    parse: Callable[[Any], Any] | None = None,
    given_as: Any = None,
) -> Any:
    """A dataclass field that is a setting. No ``default``: required (the settings may leave it None and
    fill it). ``parse`` makes the field's value from what a user gives (type ``given_as``); the bounds
    apply to each entry of a list; ``check`` is any other test (raises ValueError)."""
    if not description or "\n" in description:
        raise ValueError(f"a setting needs a one-line description, got {description!r}")
    spec = Setting(
        description, ge, gt, le, lt, None if choices is None else tuple(choices), check, parse, given_as
    )
    return dataclasses.field(default=default, metadata={_SETTING: spec})


def internal(default_factory: Callable[[], Any], source: str) -> Any:
    """A dataclass field that is no setting; ``source`` says where its value comes from."""
    return dataclasses.field(default_factory=default_factory, metadata={_INTERNAL: source})


@dataclasses.dataclass(frozen=True)
class SettingField:
    """One setting as the settings layer sees it: its key, its config class and its declaration."""

    name: str
    owner: type
    annotation: Any  # the field's type, resolved
    spec: Setting
    default: Any  # as a user writes it; dataclasses.MISSING for a required field

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    @property
    def description(self) -> str:
        return self.spec.description

    @property
    def given_type(self) -> Any:
        """The type a user gives (YAML, env, CLI); a required field may be left unset (None)."""
        given = self.spec.given_as or self.annotation
        return given | None if self.required else given

    def validate(self, value: Any) -> Any:
        return self.spec.validate(self.name, value, self.annotation)

    def values_text(self) -> str:
        """What values are valid, e.g. 'integer in [1, 256]', 'auto, torch or fused', 'true or false'."""
        spec, given = self.spec, self.spec.given_as or self.annotation
        args = [a for a in typing.get_args(given) if a is not type(None)] if _is_union(given) else [given]
        if spec.choices is not None:
            text = ", ".join(spec.choices[:-1]) + f" or {spec.choices[-1]}"
        else:
            text = " or ".join(describe_type(a).removeprefix("an ").removeprefix("a ") for a in args)
            bounds = bounds_text(spec.ge, spec.gt, spec.le, spec.lt)
            text += f" {bounds}" if bounds else ""
        optional = self.required or (_is_union(given) and type(None) in typing.get_args(given))
        return f"{text}, or unset" if optional else text


def settings_of(cls: type) -> tuple[SettingField, ...]:
    """The settings declared in dataclass ``cls``, in field order."""
    hints = _type_hints(cls)
    return tuple(
        SettingField(f.name, cls, hints[f.name], f.metadata[_SETTING], f.default)
        for f in dataclasses.fields(cls)
        if _SETTING in f.metadata
    )


def declaration(field: dataclasses.Field) -> Setting | str | None:
    """A field's :class:`Setting`, the source of an :func:`internal` field, or None (undeclared)."""
    return field.metadata.get(_SETTING) or field.metadata.get(_INTERNAL)


def check_fields(config: Any) -> None:
    """Checks every field of dataclass instance ``config`` against its declaration (its type, for an
    internal field) and stores the value ``parse`` made; raises TypeError or ValueError naming the field."""
    hints = _type_hints(type(config))
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        spec = field.metadata.get(_SETTING)
        if spec is not None:
            object.__setattr__(config, field.name, spec.validate(field.name, value, hints[field.name]))
        elif not is_instance(value, hints[field.name]):
            raise TypeError(f"{field.name} must be {describe_type(hints[field.name])}, got {value!r}")


# -- types and bounds ------------------------------------------------------------------------------


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def is_instance(value: Any, annotation: Any) -> bool:
    """isinstance for the annotations of settings: bool is no int, an int is a float, tuple[int, ...]."""
    if _is_union(annotation):
        return any(is_instance(value, arg) for arg in typing.get_args(annotation))
    if annotation is None or annotation is type(None):
        return value is None
    origin = typing.get_origin(annotation)
    if origin in (tuple, list):
        item = typing.get_args(annotation)[0]
        return isinstance(value, origin) and all(is_instance(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(annotation)
        return isinstance(value, dict) and all(
            is_instance(k, key) and is_instance(v, item) for k, v in value.items()
        )
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def describe_type(annotation: Any) -> str:
    """'an integer', 'a list of integers or None', 'a DistributedInfo', ..."""
    if _is_union(annotation):
        return " or ".join(describe_type(arg) for arg in typing.get_args(annotation))
    if annotation is None or annotation is type(None):
        return "None"
    if typing.get_origin(annotation) in (tuple, list):
        item = describe_type(typing.get_args(annotation)[0]).removeprefix("an ").removeprefix("a ")
        return f"a list of {item}s"
    if typing.get_origin(annotation) is dict:
        key, item = (
            describe_type(t).removeprefix("an ").removeprefix("a ") for t in typing.get_args(annotation)
        )
        return f"a mapping of {key}s to {item}s"
    return _TYPE_NAMES.get(annotation, f"a {getattr(annotation, '__name__', annotation)}")


def bounds_text(ge: float | None, gt: float | None, le: float | None, lt: float | None) -> str:
    """'in [1, 256]', 'in (0, 1]', '>= 1', '> 0', '' (no bounds)."""
    low, high = (ge if ge is not None else gt), (le if le is not None else lt)
    if low is not None and high is not None:
        return f"in {'[' if ge is not None else '('}{low:g}, {high:g}{']' if le is not None else ')'}"
    if low is not None:
        return f">= {low:g}" if ge is not None else f"> {low:g}"
    if high is not None:
        return f"<= {high:g}" if le is not None else f"< {high:g}"
    return ""


def _within(value: Any, ge: float | None, gt: float | None, le: float | None, lt: float | None) -> bool:
    return (
        (ge is None or value >= ge)
        and (gt is None or value > gt)
        and (le is None or value <= le)
        and (lt is None or value < lt)
    )


def as_tuple(value: Any) -> Any:
    """A list given for a tuple field becomes a tuple (anything else is left for the type check)."""
    return tuple(value) if isinstance(value, list) else value
