"""Prompt templates (`data.prompt_template`): the chat an agent starts from, rendered for every
prompt from a file under `configs/prompts/agents/` (by name) or any path.

A template is YAML with two keys:

    system: |   # optional; replaces the row's system prompt. Without it the row's own system
      ...       # prompt is kept, and a row without one gets the agent's built-in prompt
    user: |     # required; the user turn, with the question in it
      Question: {question}

Placeholders: `{question}` (the row's question: its last user message; in `user` only, where an
agent escapes untrusted text), `{system}` (the row's own system prompt, "" if none),
`{data_source}`, `{ability}` (the row's columns, "" if none). `{{` and `}}` are literal braces.
The template replaces the row's chat (earlier turns of a multi-turn prompt are dropped).
"""

from __future__ import annotations

import dataclasses
import string
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config.fields import ConfigError
from megatron_rl.records.prompt import Prompt

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "configs" / "prompts" / "agents"
PLACEHOLDERS = ("question", "system", "data_source", "ability")
PARTS = ("system", "user")


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    user: str
    system: str | None = None
    path: str = ""

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The chat of `prompt` under this template."""
        own = next((m["content"] for m in prompt.messages or [] if m["role"] == "system"), "")
        values = {"question": prompt.question, "system": own,
                  "data_source": str(prompt.metadata.get("data_source") or ""),
                  "ability": str(prompt.metadata.get("ability") or "")}
        system = self.system.format(**values) if self.system is not None else own
        user = {"role": "user", "content": self.user.format(**values)}
        return [{"role": "system", "content": system}, user] if system else [user]

    def apply(self, prompt: Prompt) -> Prompt:
        return dataclasses.replace(prompt, messages=self.messages(prompt))


def known_templates() -> list[str]:
    return sorted(p.stem for p in TEMPLATE_DIR.glob("*.yaml"))


def template_path(value: str) -> Path:
    """A bare name is `configs/prompts/agents/<name>.yaml`; anything else a path."""
    if "/" not in value and not value.endswith((".yaml", ".yml")):
        return TEMPLATE_DIR / f"{value}.yaml"
    return Path(value)


def _check_part(text: Any, part: str, where: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{where}: '{part}' must be non-empty text")
    names = []
    try:
        for _literal, name, spec, conversion in string.Formatter().parse(text):
            if name is None:
                continue
            if name not in PLACEHOLDERS or spec or conversion:
                shown = "{" + name + (f"!{conversion}" if conversion else "") + \
                        (f":{spec}" if spec else "") + "}"
                raise ConfigError(f"{where}: unknown placeholder {shown} in '{part}' (known: "
                                  f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}; write "
                                  "literal braces as {{ }})")
            names.append(name)
    except ValueError as e:  # an unmatched brace
        raise ConfigError(f"{where}: '{part}' is not a template ({e}; write literal braces as "
                          "{{ }})") from None
    if part == "user" and "question" not in names:
        raise ConfigError(f"{where}: 'user' must hold {{question}}")
    if part == "system" and "question" in names:
        raise ConfigError(f"{where}: {{question}} belongs in 'user' (the question is untrusted "
                          "text, escaped only in the user turn)")
    return text


def load_template(value: str, field: str = "data.prompt_template") -> PromptTemplate:
    """The template `value` names, checked; errors name `field` and the file."""
    path = template_path(value)
    where = f"{field}={value!r}"
    if not path.is_file():
        raise ConfigError(f"{where}: no template file {path} (templates in {TEMPLATE_DIR}: "
                          f"{', '.join(known_templates()) or 'none'})")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{where}: {path} is not YAML text ({type(e).__name__})") from None
    where = f"{where} ({path})"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a mapping with 'user' (and optionally 'system')")
    unknown = sorted(set(map(str, data)) - set(PARTS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown} (keys: system, user)")
    if "user" not in data:
        raise ConfigError(f"{where}: 'user' is required")
    system = data.get("system")
    return PromptTemplate(user=_check_part(data["user"], "user", where),
                          system=None if system is None else _check_part(system, "system", where),
                          path=str(path))
