"""Named plug-in points: every role (agent, task, judge, reward manager, engine, tool) keeps a
`Registry` of its implementations, and a recipe names one by its registered name or, for a
user's own, by import path (`my_pkg.my_module:MyAgent` or `my_pkg.my_module.MyAgent`), as
slime's `--custom-*-path` flags do. Nothing is patched into the package to add one.

Registries are created by the role's own package and hold built-ins as `module:attr` strings of
that package, imported on first use, so listing the choices (config validation, `--help`)
stays cheap.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any

# kind → registry, filled as role packages create theirs (the config reads the choices here)
REGISTRIES: dict[str, Registry] = {}
# modules whose import creates the registries, imported when a kind is asked for before it
# exists; the package root (megatron_rl/__init__.py) fills it, as this layer cannot name the
# layers above it
PROVIDERS: list[str] = []


class RegistryError(ValueError):
    """An unknown name or a dotted path that does not import; the message names the field."""


def is_import_path(name: str) -> bool:
    return ":" in name or "." in name


def import_path(path: str, where: str = "") -> Any:
    """The object at `pkg.module:attr` (or `pkg.module.attr`)."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    label = f"{where}={path!r}" if where else repr(path)
    if not module or not attr:
        raise RegistryError(f"{label}: not an import path (module:attr or module.attr)")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise RegistryError(f"{label}: cannot import module {module!r}: {e}") from e
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RegistryError(f"{label}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def registry_of(kind: str) -> Registry | None:
    """The `kind` registry, importing `PROVIDERS` first if it was not created yet; None for a
    kind no provider creates."""
    if kind not in REGISTRIES:
        for module in PROVIDERS:
            importlib.import_module(module)
    return REGISTRIES.get(kind)


class Registry:
    def __init__(self, kind: str, builtins: dict[str, str] | None = None):
        """`builtins`: name → `module:attr`, imported when first asked for."""
        if kind in REGISTRIES:
            raise RegistryError(f"a {kind} registry exists already")
        self.kind = kind
        self._lazy = dict(builtins or {})
        self._entries: dict[str, Any] = {}
        REGISTRIES[kind] = self

    def register(self, name: str) -> Callable[[Any], Any]:
        """Decorator: `@AGENTS.register("mine")` on a class or function."""
        def add(obj: Any) -> Any:
            if name in self._entries and self._entries[name] is not obj:
                raise RegistryError(f"{self.kind} {name!r} is registered already")
            self._entries[name] = obj
            return obj
        return add

    def names(self) -> list[str]:
        return sorted({*self._lazy, *self._entries})

    def check(self, name: Any, where: str) -> None:
        """A registered name, or an import path (checked only when resolved)."""
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{where}={name!r}: expected a {self.kind} name")
        if name in self._entries or name in self._lazy or is_import_path(name):
            return
        close = difflib.get_close_matches(name, self.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RegistryError(f"{where}={name!r}: unknown {self.kind}{hint}; one of "
                            f"{', '.join(self.names())}, or an import path module:attr")

    def get(self, name: str, where: str = "") -> Any:
        where = where or self.kind
        self.check(name, where)
        if name in self._entries:
            return self._entries[name]
        if name in self._lazy:
            self._entries[name] = import_path(self._lazy[name], where)
            return self._entries[name]
        return import_path(name, where)
