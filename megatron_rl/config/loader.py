"""YAML → typed dataclasses, with dotted CLI overrides and errors that name the field."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config.fields import ConfigError, from_dict
from megatron_rl.config.schema import Config

__all__ = ["CONFIG_ROOT", "ConfigError", "from_dict", "load_config", "read_yaml"]

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_ROOT = REPO_ROOT / "configs"


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # `{[1]: 2}`: `in seen` would raise TypeError
                raise yaml.constructor.ConstructorError(
                    None, None, f"found unhashable key ({type(key).__name__})",
                    key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, where: str) -> Any:
    """Safe YAML (no tags that build objects, no duplicate keys); errors name `where`."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: no object-building tags
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None
    except RecursionError:  # PyYAML composes and constructs recursively
        raise ConfigError(f"{where}: not valid YAML: nested too deeply") from None


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["train.lr=1e-6", "parallel.tp=2"]` → nested dict (values parsed as YAML scalars)."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like section.key=value")
        key, raw = item.split("=", 1)
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override '{item}': empty key")
        value = load_yaml(raw, f"override '{item}'") if raw != "" else ""
        node = nested
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}' conflicts with an earlier override")
        node[leaf] = value
    return nested


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        both_dicts = isinstance(v, dict) and isinstance(out.get(k), dict)
        out[k] = deep_merge(out[k], v) if both_dicts else v
    return out


def resolve_recipe(recipe: str) -> Path:
    """A recipe is a YAML path, or a name under configs/recipes/."""
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {path}")
        return path
    candidate = CONFIG_ROOT / "recipes" / f"{recipe}.yaml"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in (CONFIG_ROOT / "recipes").glob("*.yaml"))
    match = difflib.get_close_matches(recipe, known, n=1)
    hint = f" (did you mean '{match[0]}'?)" if match else ""
    raise ConfigError(f"unknown recipe '{recipe}'{hint}; known: {', '.join(known)}")


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    data = load_yaml(text, str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


def load_config(recipe: str | None = None, overrides: list[str] | None = None) -> Config:
    data = read_yaml(resolve_recipe(recipe)) if recipe else {}
    data = deep_merge(data, parse_overrides(overrides or []))
    cfg = from_dict(Config, data)
    cfg.check()
    return cfg


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def to_yaml(obj: Any) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False)
