"""SGLang's request schema and server flags, pinned as JSON fixtures, and a validator for them.

SGLang needs a GPU to run and its `io_struct` module imports half of its runtime, so the schema is
read from the released wheel's *source* with `ast` (no import, no GPU): the request structs of
`srt/managers/io_struct.py`, the HTTP routes of `srt/entrypoints/http_server.py` (path → body
struct), the generated JSON contract of `api/v1/api_types.py` (what `/generate` admits and what
its response holds), `SamplingParams`, the CLI flags of `ServerArgs` (assembled from the
`arg_groups/fields/` namespaces plus the hand-registered ones in `server_args.py`), the
`SafeUnpickler` allow-list and `FlattenedTensorMetadata` (the weight-update wire format), and
the router's flags from the `sglang-router` wheel.

Regenerate (writes tests/fixtures/sglang/{io_struct,server}_<version>.json):

    pip download sglang==0.5.23 sglang-router==0.3.2 --no-deps -d /tmp/sgl
    python -m megatron_rl.engines.sglang_schema --wheel /tmp/sgl/sglang-0.5.23-*.whl \
        --router-wheel /tmp/sgl/sglang_router-0.3.2-*.whl

`TypeChecker` checks a JSON body against one struct: every key must be a field, every required
field present, and each value must fit the field's annotation (checked from its source text).
The tests load the fixtures and run it (`tests/sglang_fixtures.py`).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

FIXTURE_DIR = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "sglang"
SGLANG_VERSION = "0.5.23"

# ---------------------------------------------------------------------------------------------
# extraction (source text → plain data)
# ---------------------------------------------------------------------------------------------


def _is_dataclass_decorator(d: ast.expr) -> bool:
    target = d.func if isinstance(d, ast.Call) else d
    return ast.unparse(target) in ("dataclass", "dataclasses.dataclass")


def _field_has_default(value: ast.expr | None) -> bool:
    if value is None:
        return False
    # dataclasses.field(...) / msgspec.field(...) without default(_factory) is still required
    if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "field":
        return any(k.arg in ("default", "default_factory") for k in value.keywords)
    return True


def extract_structs(source: str, *, known_bases: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """Module-level dataclasses and msgspec Structs: name → kind, bases, doc flags, fields.

    Fields of a base class defined in the same file are merged in first (msgspec and dataclass
    inheritance both put base fields first). `required` means no default.
    """
    tree = ast.parse(source)
    out: dict[str, dict[str, Any]] = {}
    struct_bases = {"msgspec.Struct", "Struct", *known_bases}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        bases = [ast.unparse(b) for b in node.bases]
        is_dc = any(_is_dataclass_decorator(d) for d in node.decorator_list)
        is_struct = any(b in struct_bases or b in out for b in bases)
        if not (is_dc or is_struct):
            continue
        fields: dict[str, dict[str, Any]] = {}
        for b in bases:
            if b in out:
                fields.update({k: dict(v) for k, v in out[b]["fields"].items()})
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            ann = ast.unparse(stmt.annotation)
            if ann.startswith(("ClassVar", "typing.ClassVar")):
                continue
            entry: dict[str, Any] = {"type": ann, "required": not _field_has_default(stmt.value)}
            if stmt.value is not None:
                entry["default"] = ast.unparse(stmt.value)
            fields[stmt.target.id] = entry
        doc = ast.get_docstring(node) or ""
        out[node.name] = {
            "kind": "dataclass" if is_dc else "msgspec",
            "bases": bases,
            "fields": fields,
            # api_types.py states the unknown-key policy of each JSON object in its docstring
            "rejects_unknown_keys": "unknown keys rejected" in doc,
        }
    return out


def extract_aliases(source: str) -> dict[str, str]:
    """Module-level type aliases `Name = <type expression>` (api_types.py's JSON shapes)."""
    out = {}
    for node in ast.parse(source).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id[:1].isupper()
                and isinstance(node.value, (ast.Subscript, ast.Name))):
            out[node.targets[0].id] = ast.unparse(node.value)
    return out


def extract_routes(source: str, struct_names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """FastAPI routes of http_server.py: path → methods and the request-body struct, if any."""
    names = set(struct_names)
    out: dict[str, dict[str, Any]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = None
        for arg in node.args.args:
            if arg.annotation is None:
                continue
            for n in ast.walk(arg.annotation):
                if isinstance(n, ast.Name) and n.id in names:
                    body = n.id
                    break
            if body:
                break
        for d in node.decorator_list:
            if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                    and ast.unparse(d.func.value) == "app" and d.args
                    and isinstance(d.args[0], ast.Constant)):
                continue
            verb = d.func.attr
            if verb == "api_route":
                methods = next((ast.literal_eval(k.value) for k in d.keywords
                                if k.arg == "methods"), ["GET"])
            elif verb in ("get", "post", "put", "delete", "head"):
                methods = [verb.upper()]
            else:
                continue
            route = out.setdefault(d.args[0].value, {"methods": [], "body": body,
                                                     "handler": node.name})
            route["methods"] = sorted(set(route["methods"]) | set(methods))
    return dict(sorted(out.items()))


def _field_to_cli_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _const_strings(node: ast.expr) -> list[str]:
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant)]
    return []


def extract_server_flags(field_sources: Iterable[str], server_args_source: str) -> list[str]:
    """The `--flags` `ServerArgs.add_cli_args` registers in this release.

    Mirrors `arg_utils.add_cli_args_from_dataclass`: every `A[T, "help"]` / `A[T, Arg(...)]`
    field of a namespace class (one with `_NS_PATH`) becomes `--field-name` (or `cli_name`)
    plus its `aliases` (and `--no-*` twins for BooleanOptionalAction), unless `no_cli=True`;
    then the flags `add_cli_args` adds by hand. `--help` is argparse's own.
    """
    flags: set[str] = set()
    for src in field_sources:
        for cls in ast.parse(src).body:
            if not isinstance(cls, ast.ClassDef):
                continue
            if not any(isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "_NS_PATH"
                       for s in cls.body):
                continue
            for stmt in cls.body:
                if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                    continue
                ann = stmt.annotation
                if not (isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "A"):
                    continue
                parts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
                meta = parts[1] if len(parts) > 1 else None
                names = [_field_to_cli_name(stmt.target.id)]
                if isinstance(meta, ast.Call) and ast.unparse(meta.func) == "Arg":
                    kw = {k.arg: k.value for k in meta.keywords}
                    if isinstance(kw.get("no_cli"), ast.Constant) and kw["no_cli"].value:
                        continue
                    if isinstance(kw.get("cli_name"), ast.Constant):
                        names = [kw["cli_name"].value]
                    names += _const_strings(kw.get("aliases", ast.Constant(None)))
                    if "BooleanOptionalAction" in ast.unparse(kw.get("action", ast.Constant(None))):
                        names += ["--no-" + n[2:] for n in names if n.startswith("--")]
                elif not (isinstance(meta, ast.Constant) and isinstance(meta.value, str)):
                    continue  # no Arg metadata: add_cli_args_from_dataclass skips the field
                flags.update(names)
    tree = ast.parse(server_args_source)
    add_cli = next(n for n in ast.walk(tree)
                   if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args")
    for call in ast.walk(add_cli):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "add_argument"):
            flags.update(a.value for a in call.args
                         if isinstance(a, ast.Constant) and str(a.value).startswith("--"))
    return sorted(flags)


def extract_router_flags(router_args_source: str) -> list[str]:
    """`sglang_router.launch_router` flags (RouterArgs.add_cli_args with no 'router-' prefix)."""
    flags: set[str] = set()
    for call in ast.walk(ast.parse(router_args_source)):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "add_argument"):
            continue
        for a in call.args:
            if isinstance(a, ast.Constant) and str(a.value).startswith("--"):
                flags.add(a.value)
            elif isinstance(a, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "" for v in a.values)
                if text.startswith("--"):
                    flags.add(text)
    return sorted(flags)


def extract_unpickler_allowlist(common_source: str) -> list[list[str]]:
    """`SafeUnpickler.ALLOWED_GLOBALS`: what a `/update_weights_from_tensor` pickle may name."""
    for node in ast.walk(ast.parse(common_source)):
        if isinstance(node, ast.ClassDef) and node.name == "SafeUnpickler":
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) == (
                        "ALLOWED_GLOBALS"):
                    return sorted([list(t) for t in ast.literal_eval(stmt.value)])
    raise ValueError("SafeUnpickler.ALLOWED_GLOBALS not found")


def _read(zf: zipfile.ZipFile, member: str) -> str:
    return zf.read(member).decode("utf-8")


def build_fixtures(wheel: Path, router_wheel: Path | None) -> dict[str, dict[str, Any]]:
    """Both fixtures from the sglang (and sglang-router) wheels, read in place."""
    with zipfile.ZipFile(wheel) as zf:
        version = next(re.search(r"sglang-([^-]+)\.dist-info/", n).group(1)
                       for n in zf.namelist() if re.search(r"sglang-[^-]+\.dist-info/", n))
        io_src = _read(zf, "sglang/srt/managers/io_struct.py")
        io_structs = extract_structs(io_src)
        api_src = _read(zf, "sglang/api/v1/api_types.py")
        field_srcs = [_read(zf, n) for n in sorted(zf.namelist())
                      if n.startswith("sglang/srt/arg_groups/fields/") and n.endswith(".py")]
        server = {
            "sglang_version": version,
            "routes": extract_routes(_read(zf, "sglang/srt/entrypoints/http_server.py"),
                                     io_structs),
            "api_v1": {"structs": extract_structs(api_src),
                       "aliases": extract_aliases(api_src)},
            "sampling_params": extract_structs(
                _read(zf, "sglang/srt/sampling/sampling_params.py"))["SamplingParams"],
            "tensor_bucket": extract_structs(
                _read(zf, "sglang/srt/weight_sync/tensor_bucket.py")),
            "safe_unpickler_globals": extract_unpickler_allowlist(
                _read(zf, "sglang/srt/utils/common.py")),
            "server_flags": extract_server_flags(field_srcs,
                                                 _read(zf, "sglang/srt/server_args.py")),
        }
    if router_wheel is not None:
        with zipfile.ZipFile(router_wheel) as zf:
            rversion = next(re.search(r"sglang_router-([^-]+)\.dist-info/", n).group(1)
                            for n in zf.namelist() if "sglang_router-" in n and ".dist-info/" in n)
            server["router"] = {"version": rversion, "flags": extract_router_flags(
                _read(zf, "sglang_router/router_args.py"))}
    header = {"generated_by": "python -m megatron_rl.engines.sglang_schema",
              "source": wheel.name}
    return {
        f"io_struct_{version}.json": {**header, "sglang_version": version, "structs": io_structs},
        f"server_{version}.json": {**header, **server},
    }


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


_PRIMITIVES = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    # JSON has no bytes: SGLang's HTTP schema takes base64 strings for `bytes` fields
    "bytes": lambda v: isinstance(v, str),
    "None": lambda v: v is None,
    "NoneType": lambda v: v is None,
}
_ANY = {"Any", "object"}


class TypeChecker:
    """Checks a JSON value against a Python annotation given as source text.

    Handles Optional/Union/List/Dict/Tuple/Literal/Annotated, the primitives, aliases and the
    structs of one schema (nested objects are validated field by field). A name it does not
    know is accepted and reported in `unchecked`, so nothing passes silently unnoticed.
    """

    def __init__(self, structs: dict[str, dict[str, Any]], aliases: dict[str, str] | None = None,
                 strict: bool = True):
        self.structs = structs
        self.aliases = aliases or {}
        # strict: every key must be a field; else only where the struct rejects unknown keys
        self.strict = strict
        self.unchecked: set[str] = set()

    def check(self, value: Any, annotation: str, where: str) -> list[str]:
        return self._check(value, ast.parse(annotation, mode="eval").body, where)

    def _check(self, v: Any, t: ast.expr, where: str) -> list[str]:
        if isinstance(t, ast.Constant):
            if t.value is None:
                return [] if v is None else [f"{where}: expected null, got {v!r}"]
            if isinstance(t.value, str):  # forward reference
                return self._check(v, ast.parse(t.value, mode="eval").body, where)
        if isinstance(t, ast.BinOp) and isinstance(t.op, ast.BitOr):
            return self._union(v, [t.left, t.right], where)
        name = ast.unparse(t.value if isinstance(t, ast.Subscript) else t).split(".")[-1]
        args: list[ast.expr] = []
        if isinstance(t, ast.Subscript):
            args = list(t.slice.elts) if isinstance(t.slice, ast.Tuple) else [t.slice]
        if name in _ANY:
            return []
        if name in _PRIMITIVES:
            return [] if _PRIMITIVES[name](v) else [f"{where}: expected {name}, got {v!r}"]
        if name == "Optional":
            return [] if v is None else self._check(v, args[0], where)
        if name == "Union":
            return self._union(v, args, where)
        if name == "Annotated":
            return self._check(v, args[0], where)
        if name == "Literal":
            allowed = [ast.literal_eval(a) for a in args]
            return [] if v in allowed else [f"{where}: {v!r} is not one of {allowed}"]
        if name in ("List", "list", "Sequence", "Tuple", "tuple"):
            if not isinstance(v, list):
                return [f"{where}: expected a list, got {v!r}"]
            if not args:
                return []
            errs: list[str] = []
            for i, x in enumerate(v):
                errs += self._check(x, args[0] if name not in ("Tuple", "tuple") or len(args) == 1
                                    else args[min(i, len(args) - 1)], f"{where}[{i}]")
            return errs
        if name in ("Dict", "dict", "Mapping"):
            if not isinstance(v, dict):
                return [f"{where}: expected an object, got {v!r}"]
            if len(args) == 2:
                return [e for k, x in v.items() for e in self._check(x, args[1], f"{where}.{k}")]
            return []
        if name in self.aliases:
            return self._check(v, ast.parse(self.aliases[name], mode="eval").body, where)
        if name in self.structs:
            if not isinstance(v, dict):
                # LogprobEntry and friends are positional JSON arrays
                return [] if isinstance(v, list) else [f"{where}: expected {name}, got {v!r}"]
            return self.body_errors(v, name, where)
        self.unchecked.add(name)
        return []

    def _union(self, v: Any, options: list[ast.expr], where: str) -> list[str]:
        results = [self._check(v, o, where) for o in options]
        if any(not r for r in results):
            return []
        # report the one option of the value's own JSON kind, if there is exactly one
        same_kind = [r for r in results if not (len(r) == 1 and r[0].startswith(
            f"{where}: expected"))]
        if len(same_kind) == 1:
            return same_kind[0]
        return [f"{where}: {v!r} fits none of " + " | ".join(ast.unparse(o) for o in options)]

    def body_errors(self, body: dict[str, Any], struct: str, where: str = "") -> list[str]:
        spec = self.structs[struct]
        prefix = f"{where}." if where else ""
        errs = []
        if self.strict or spec.get("rejects_unknown_keys"):
            errs += [f"{struct}: unknown field '{prefix}{k}'" for k in body
                     if k not in spec["fields"]]
        errs += [f"{struct}: required field '{prefix}{k}' missing"
                 for k, f in spec["fields"].items() if f["required"] and k not in body]
        for k, x in body.items():
            if k in spec["fields"]:
                errs += self.check(x, spec["fields"][k]["type"], f"{struct}.{prefix}{k}")
        return errs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheel", type=Path, required=True, help="sglang-<version>-*.whl")
    p.add_argument("--router-wheel", type=Path, help="sglang_router-<version>-*.whl")
    p.add_argument("--out", type=Path, default=FIXTURE_DIR)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in build_fixtures(args.wheel, args.router_wheel).items():
        (args.out / name).write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
        print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
