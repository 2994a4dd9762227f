"""Chat formats per model family: how a tool call is written, how a tool response is wrapped
and how thinking is shown, so that what an agent feeds a model is what the model's own chat
template renders, token for token.

- `qwen3`: Qwen3 (architectures `qwen3`, `qwen3_moe`); a call is
  `<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>`.
- `qwen3_5`: Qwen3.5 / 3.6 (`qwen3_5_moe`); a call is `<tool_call>\\n<function=NAME>\\n` then
  `<parameter=KEY>\\nVALUE\\n</parameter>\\n` per argument, then `</function>\\n</tool_call>`;
  VALUE is a string as it is, anything else as JSON text.

Both answer tools in a user turn of `\\n<tool_response>\\n…\\n</tool_response>` blocks (Qwen3.5's
template trims the content first) and think in `<think>\\n…\\n</think>\\n\\n` before the reply.
Whether the generation prompt already opened that block (Qwen3.5's does, Qwen3's does not) is
read from the template itself (`ChatFormat.think_prefix`), not from the family.

`AgentConfig.chat_format` picks the family: `auto` reads the tokenizer's chat template (XML-style
`<function=` calls → `qwen3_5`, else `qwen3`; the template is what the model was trained on,
and Qwen3-Coder, a `qwen3_moe`, writes XML calls too), a family name or a model architecture
picks it explicitly. The parser reads both call syntaxes whatever the family
(`tool_parser.parse_action`): a model may write either.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

Call = tuple[str, Mapping[str, Any]]  # (tool name, arguments)


class ChatFamily(Protocol):
    name: ClassVar[str]

    def tool_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One tool call, exactly as the family's template renders an assistant's `tool_calls`."""
        ...

    def response_content(self, content: str) -> str:
        """A tool result as the template puts it inside `<tool_response>` (before escaping)."""
        ...

    def assistant_text(self, content: str = "", calls: Sequence[Call] = (),
                       reasoning: str | None = None, *, think_open: bool = False) -> str:
        """An assistant output as the template lays it out (thinking, text, calls); with
        `think_open` the generation prompt already opened `<think>\\n`."""
        ...


def _think(reasoning: str | None, think_open: bool) -> str:
    if reasoning is None:
        return ""
    return ("" if think_open else "<think>\n") + reasoning + "\n</think>\n\n"


class Qwen3Format:
    name: ClassVar[str] = "qwen3"

    def tool_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        # the template writes '{"name": "' + name + '", "arguments": ' + arguments|tojson + '}'
        body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"

    def response_content(self, content: str) -> str:
        return content

    def assistant_text(self, content: str = "", calls: Sequence[Call] = (),
                       reasoning: str | None = None, *, think_open: bool = False) -> str:
        if reasoning is None:
            text = content
        else:
            text = _think(reasoning.strip("\n"), think_open) + content.lstrip("\n")
        for i, (name, args) in enumerate(calls):
            text += ("\n" if i or content else "") + self.tool_call(name, args)
        return text


class Qwen35Format:
    name: ClassVar[str] = "qwen3_5"

    def tool_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        params = "".join(f"<parameter={key}>\n{xml_value(value)}\n</parameter>\n"
                         for key, value in arguments.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"

    def response_content(self, content: str) -> str:
        return content.strip()  # the template renders `content|trim`

    def assistant_text(self, content: str = "", calls: Sequence[Call] = (),
                       reasoning: str | None = None, *, think_open: bool = False) -> str:
        content = content.strip()
        text = _think(None if reasoning is None else reasoning.strip(), think_open) + content
        for i, (name, args) in enumerate(calls):
            text += ("\n" if i else "\n\n" if content else "") + self.tool_call(name, args)
        return text


def xml_value(value: Any) -> str:
    """A parameter value in the XML call syntax: a string as it is, anything else as JSON text
    (numbers, lists, objects, `true`/`false`/`null`)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


FAMILIES: dict[str, ChatFamily] = {"qwen3": Qwen3Format(), "qwen3_5": Qwen35Format()}
# model architectures (models/registry.py) → family
ARCHITECTURES = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen3_5_moe": "qwen3_5"}
CHOICES = ("auto", *FAMILIES, *sorted(set(ARCHITECTURES) - set(FAMILIES)))


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates (default, tool_use, …)
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def detect_family(tokenizer: Any) -> ChatFamily:
    """The family the tokenizer's chat template writes tool calls in."""
    return FAMILIES["qwen3_5" if "<function=" in _template_text(tokenizer) else "qwen3"]


def chat_family(choice: str, tokenizer: Any = None) -> ChatFamily:
    """`auto` (from the chat template), a family name, or a model architecture."""
    if choice == "auto":
        return detect_family(tokenizer)
    name = ARCHITECTURES.get(choice, choice)
    if name not in FAMILIES:
        raise ValueError(f"chat_format={choice!r}: expected one of {', '.join(CHOICES)}")
    return FAMILIES[name]
