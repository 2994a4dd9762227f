"""The pinned SGLang schema fixtures (tests/fixtures/sglang, written by
`python -m megatron_rl.engines.sglang_schema`) and the contract check the tests run on them."""

from __future__ import annotations

import json
from typing import Any

from megatron_rl.engines.sglang_schema import FIXTURE_DIR, SGLANG_VERSION, TypeChecker


def load_fixture(kind: str, version: str = SGLANG_VERSION) -> dict[str, Any]:
    """`kind` is 'io_struct' or 'server'."""
    return json.loads((FIXTURE_DIR / f"{kind}_{version}.json").read_text())


def validate_body(body: dict[str, Any], struct: str, structs: dict[str, dict[str, Any]],
                  aliases: dict[str, str] | None = None, strict: bool = True) -> list[str]:
    """Contract violations of `body` against `structs[struct]` (empty list = valid).

    strict=False follows each struct's own unknown-key policy (api/v1's JSON contract).
    """
    if struct not in structs:
        return [f"{struct}: no such struct in the schema"]
    return TypeChecker(structs, aliases, strict).body_errors(body, struct)
