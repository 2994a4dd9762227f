"""Prompts from verl-schema parquet (or JSONL) files, checked at load.

One row per prompt, the columns verl's RL datasets use:

- `data_source` (str): kept in the prompt's metadata (per-source metrics, judges);
- `prompt` (list of {role, content}, or a bare string): the chat the model sees; its last user
  message is the question;
- `ability` (str, optional): metadata;
- `reward_model` ({ground_truth: str | list | {target: str | list}, style?}): the reference
  answer(s), verl's plain string or LiteResearcher's nested target;
- `extra_info` (dict, optional): `index` (the row's id), `bucket` / `difficulty` (curriculum),
  anything else kept;
- `tools_kwargs` (dict, optional, or `extra_info.tools_kwargs`): per-tool arguments for this
  row's episodes; its keys must be tool names. Each value is `{argument: value}` (e.g.
  `{search: {top_k: 3}}`), or verl's `{create_kwargs, execute_kwargs, calc_reward_kwargs,
  release_kwargs}`, of which `execute_kwargs` are the arguments (the others configure verl's
  stateful tool instances, which these tools do not have). The arguments are checked against
  the tool's schema and fixed for the row: they override what the model passes (`Prompt.metadata
  ["tool_arguments"]`, applied by `env.base.row_arguments`).

Every problem is a `DataError` naming the file, the row and the field, raised when the files
are read (a `tools_kwargs` key that is no tool fails here, not mid-rollout).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_rl.env.base import validate_arguments
from megatron_rl.records.prompt import Prompt

ROLES = ("system", "user", "assistant", "tool")
# verl's per-tool entries; `execute_kwargs` go with every call
VERL_TOOL_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")
MAX_TEXT = 1 << 20  # characters of one message: a prompt is not a corpus


class DataError(ValueError):
    """A data file, row or field that cannot be used; the message names it."""


def iter_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of a .jsonl (blank lines skipped) or .parquet file."""
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises many types for a broken file
            raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: "
                            f"{e})") from None
        for i, row in enumerate(rows):
            yield f"{path} row {i}", row
        return
    if path.suffix not in (".jsonl", ".json"):
        raise DataError(f"{path}: data files are .parquet or .jsonl")
    with path.open("rb") as f:
        for i, raw in enumerate(f):
            where = f"{path} line {i + 1}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 text (byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                raise DataError(f"{where}: not JSON ({e})") from None


def _answers(value: Any, where: str) -> list[str]:
    """reward_model.ground_truth as verl writes it (a string), as a list of accepted answers,
    or LiteResearcher's {target: str | list}."""
    if isinstance(value, dict):
        if "target" not in value:
            raise DataError(f"{where}.ground_truth: a mapping needs a 'target' key")
        value, where = value["target"], f"{where}.ground_truth.target"
    else:
        where = f"{where}.ground_truth"
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        value = [str(value)]
    if not isinstance(value, (list, tuple)) or not value or \
            not all(isinstance(v, str) and v.strip() for v in value):
        raise DataError(f"{where}: a non-empty string or list of strings, got {value!r:.80}")
    return list(value)


def check_messages(value: Any, where: str) -> list[dict[str, str]]:
    """A non-empty list of {role, content} chat messages with known roles and bounded text."""
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: a non-empty list of chat messages")
    out = []
    for i, m in enumerate(value):
        w = f"{where}[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES or \
                not isinstance(m.get("content"), str):
            raise DataError(f"{w}: a message {{role: {'|'.join(ROLES)}, content: str}}, got "
                            f"{m!r:.80}")
        if len(m["content"]) > MAX_TEXT:
            raise DataError(f"{w}.content: {len(m['content'])} characters (at most {MAX_TEXT})")
        out.append({k: v for k, v in m.items()})
    return out


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if isinstance(value, str):  # a bare question
        value = [{"role": "user", "content": value}]
    out = [{"role": m["role"], "content": m["content"]} for m in check_messages(value, where)]
    if not any(m["role"] == "user" and m["content"].strip() for m in out):
        raise DataError(f"{where}: no user message with text (the question)")
    return out


def _mapping(value: Any, where: str) -> Any:
    """A dict column, also when a writer stored it as JSON text (parquet cannot hold an empty
    struct, so datasets often do)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            raise DataError(f"{where}: neither a mapping nor JSON text of one") from None
    return value


def tool_arguments(tools_kwargs: dict[str, Any], where: str,
                   parameters: Mapping[str, Mapping[str, Any] | None] | None = None
                   ) -> dict[str, dict[str, Any]]:
    """A row's `tools_kwargs` → {tool: arguments} (verl's layout: its `execute_kwargs`), each
    argument checked against the tool's JSON schema in `parameters` when it is known."""
    out = {}
    for name, entry in tools_kwargs.items():
        w = f"{where}.{name}"
        entry = _mapping(entry, w)
        if not isinstance(entry, dict):
            raise DataError(f"{w}: a mapping of argument → value, got {type(entry).__name__}")
        verl = [k for k in entry if k in VERL_TOOL_KEYS]
        if verl:
            if len(verl) != len(entry):
                raise DataError(f"{w}: mixes verl's {verl} with arguments "
                                f"{sorted(set(entry) - set(verl))}")
            w += ".execute_kwargs"
            entry = _mapping(entry.get("execute_kwargs"), w)
            if not isinstance(entry, dict):
                raise DataError(f"{w}: a mapping of argument → value")
        schema = (parameters or {}).get(name)
        if schema is not None and entry:
            # only the given keys: the model still writes the required ones (the query)
            problem = validate_arguments({"properties": schema.get("properties", {})}, entry)
            if problem is not None:
                raise DataError(f"{w}: {problem}")
        if entry:
            out[str(name)] = dict(entry)
    return out


def parse_row(row: Any, where: str, tool_names: Iterable[str] | None = None,
              tool_parameters: Mapping[str, Mapping[str, Any] | None] | None = None) -> Prompt:
    """One verl row → a `Prompt` (question = the last user message). `tool_names`: the run's
    tools (a `tools_kwargs` key that is none is an error); `tool_parameters`: their argument
    schemas, by name, to check the values against (None for a tool whose schema is unknown)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row is a mapping of columns, got {type(row).__name__}")
    for column in ("prompt", "reward_model"):
        if row.get(column) is None:
            raise DataError(f"{where}: missing column '{column}'")
    messages = _messages(row["prompt"], f"{where}.prompt")
    reward = row["reward_model"]
    if not isinstance(reward, dict) or "ground_truth" not in reward:
        raise DataError(f"{where}.reward_model: a mapping with 'ground_truth'")
    answers = _answers(reward["ground_truth"], f"{where}.reward_model")
    extra = _mapping(row.get("extra_info"), f"{where}.extra_info")
    if not isinstance(extra, dict):
        raise DataError(f"{where}.extra_info: a mapping, got {type(extra).__name__}")
    tools_kwargs = _mapping(row.get("tools_kwargs") or extra.get("tools_kwargs"),
                            f"{where}.tools_kwargs")
    if not isinstance(tools_kwargs, dict):
        raise DataError(f"{where}.tools_kwargs: a mapping of tool name → arguments")
    if tool_names is None and tool_parameters is not None:
        tool_names = list(tool_parameters)
    if tool_names is not None:
        unknown = sorted(set(tools_kwargs) - set(tool_names))
        if unknown:
            raise DataError(f"{where}.tools_kwargs: {unknown} are not tools of this run "
                            f"(tools: {', '.join(sorted(tool_names))})")
    arguments = tool_arguments(tools_kwargs, f"{where}.tools_kwargs", tool_parameters)
    for field in ("data_source", "ability"):
        if row.get(field) is not None and not isinstance(row[field], str):
            raise DataError(f"{where}.{field}: a string")
    question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    answer = answers[0] if len(answers) == 1 else json.dumps(answers)
    return Prompt(question, answer, uid="", messages=messages, metadata={
        "data_source": row.get("data_source") or "", "ability": row.get("ability") or "",
        "extra_info": extra, "tools_kwargs": tools_kwargs, "tool_arguments": arguments})


def bucket_of(prompt: Prompt) -> Any:
    extra = prompt.metadata.get("extra_info", {})
    return extra.get("bucket", extra.get("difficulty", 0))


def read_prompts(files: Sequence[str | Path], *, tool_names: Iterable[str] | None = None,
                 curriculum: str = "none",
                 tool_parameters: Mapping[str, Mapping[str, Any] | None] | None = None
                 ) -> list[Prompt]:
    """Every row of `files`, in file and row order (`curriculum="bucket"`: stable-sorted by
    `extra_info.bucket`, else `.difficulty`). A prompt's uid is `extra_info.index` if given,
    else `<file stem>:<row>`; uids must be unique (they are the GRPO group ids)."""
    names = None if tool_names is None else set(tool_names)
    prompts: list[Prompt] = []
    seen: dict[str, str] = {}
    for f in files:
        path = Path(f)
        for i, (where, row) in enumerate(iter_rows(path)):
            p = parse_row(row, where, names, tool_parameters)
            index = p.metadata["extra_info"].get("index")
            p.uid = f"{path.stem}:{index if index is not None else i}"
            if p.uid in seen:
                raise DataError(f"{where}: uid {p.uid!r} repeats {seen[p.uid]} (extra_info.index "
                                "must be unique per file)")
            seen[p.uid] = where
            prompts.append(p)
    if not prompts:
        raise DataError(f"no rows in {', '.join(map(str, files))}")
    if curriculum == "bucket":
        try:
            prompts.sort(key=bucket_of)
        except TypeError:
            raise DataError("data.curriculum=bucket: extra_info.bucket values are not "
                            "comparable (mix of numbers and strings?)") from None
    elif curriculum != "none":
        raise DataError(f"data.curriculum={curriculum!r}: 'none' or 'bucket'")
    return prompts
