"""Typed config fields: declared ranges and choices, lossless coercion from YAML values, and
errors that name the field. Every section dataclass (`schema.py`, and components' own
sections) is built through `from_dict`."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import field
from typing import Any

from megatron_rl.utils.registry import RegistryError, registry_of


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, choices: tuple | None = None,
            registry: str | None = None, help: str = "") -> Any:
    """A dataclass field with a validated range, a set of choices, or the names of a
    registry (`utils/registry.py`: its registered names, or an import path)."""
    meta = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt, choices=choices,
                                  registry=registry).items() if v is not None}
    meta["help"] = help
    return field(default=default, metadata=meta)


class ConfigError(ValueError):
    """A config value is unknown, mistyped or out of range. The message names the field."""


def dotted_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        sub = _dataclass_type(_field_types(cls)[f.name])
        keys += dotted_keys(sub, f"{prefix}{f.name}.") if sub else [f"{prefix}{f.name}"]
    return keys


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _dataclass_type(tp: Any) -> type | None:
    """The dataclass behind `tp` (also inside `X | None`), else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = inner[0] if len(inner) == 1 else None
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _unknown_key(name: str, cls: type, root: type | None) -> ConfigError:
    candidates = dotted_keys(root or cls)
    if "." not in name:  # a top-level section name
        candidates = [f.name for f in dataclasses.fields(root or cls)] + candidates
    leaf = name.rsplit(".", 1)[-1]
    by_leaf: dict[str, list[str]] = {}
    for k in candidates:
        by_leaf.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    # the same key in another section (`train.lr` → `optim.lr`), then a typo of a key name
    # (`optim.lrr` → `optim.lr`), then anything close as a whole
    close_leaf = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
    if leaf in by_leaf:
        match = by_leaf[leaf][0]
    elif close_leaf:
        options = by_leaf[close_leaf[0]]
        match = (difflib.get_close_matches(name, options, n=1, cutoff=0) or options)[0]
    else:
        match = next(iter(difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)), None)
    hint = f" (did you mean '{match}'?)" if match else ""
    return ConfigError(f"unknown config key '{name}'{hint}")


def _coerce(name: str, tp: Any, value: Any) -> Any:
    """Check `value` against the annotation `tp`; allow only lossless conversions."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(name, arg, value)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{name}: cannot be None")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}={value!r}: expected a list")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return origin(_coerce(f"{name}[{i}]", item, v) for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name}={value!r}: expected a mapping")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-6` as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name}={value!r}: expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}={value!r}: expected a string")
    raise ConfigError(f"{name}: unsupported annotation {tp}")


def check_bounds(name: str, value: Any, meta: typing.Mapping[str, Any]) -> None:
    if value is None:
        return
    if "registry" in meta:
        check_registered(name, value, meta["registry"])
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}={value!r}: must be a finite number")
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{name}={value!r}: must be one of {list(meta['choices'])}")
    if "ge" in meta and value < meta["ge"]:
        raise ConfigError(f"{name}={value!r}: must be >= {meta['ge']}")
    if "gt" in meta and value <= meta["gt"]:
        raise ConfigError(f"{name}={value!r}: must be > {meta['gt']}")
    if "le" in meta and value > meta["le"]:
        raise ConfigError(f"{name}={value!r}: must be <= {meta['le']}")
    if "lt" in meta and value >= meta["lt"]:
        raise ConfigError(f"{name}={value!r}: must be < {meta['lt']}")


def check_registered(name: str, value: Any, kind: str) -> None:
    """A name (or list of names) of the `kind` registry, or an import path (checked when it is
    resolved). `registry_of` imports the registries first if this process has not (the
    package root names the module that creates them), so the check does not depend on what
    was imported before the config was loaded."""
    registry = registry_of(kind)
    for i, item in enumerate(value if isinstance(value, (list, tuple)) else [value]):
        where = f"{name}[{i}]" if isinstance(value, (list, tuple)) else name
        if not isinstance(item, str) or not item:
            raise ConfigError(f"{where}={item!r}: expected a {kind} name")
        if registry is not None:
            try:
                registry.check(item, where)
            except RegistryError as e:
                raise ConfigError(str(e)) from None


def from_dict[T](cls: type[T], data: dict[str, Any] | None, prefix: str = "",
              root: type | None = None) -> T:
    """Build dataclass `cls` from a nested mapping, validating every key and value."""
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = _field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise _unknown_key(f"{prefix}{key}", cls, root)
    kwargs = {}
    for key, value in data.items():
        name, tp = f"{prefix}{key}", hints[key]
        sub = _dataclass_type(tp)
        if sub is not None:
            kwargs[key] = None if value is None else from_dict(sub, value, f"{name}.", root or cls)
        else:
            kwargs[key] = _coerce(name, tp, value)
            check_bounds(name, kwargs[key], fields[key].metadata)
    obj = cls(**kwargs)
    # defaults must also satisfy the bounds (guards against a bad schema edit)
    for key, f in fields.items():
        if key not in kwargs and _dataclass_type(hints[key]) is None:
            check_bounds(f"{prefix}{key}", getattr(obj, key), f.metadata)
    return obj
