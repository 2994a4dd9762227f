"""ChatML prompts (Qwen3, Qwen3.5), token in, token out.

The first context of an episode is the tokenizer's chat template (a system prompt, the tools in
the template's `<tools>…</tools>` block, then the user question; or the data's own chat)
rendered and tokenized once. After that nothing is ever re-tokenized: each turn appends exactly
the ids the engine produced, then the observation (a tool-response turn in the model family's
format, `formats.py`) tokenized on its own. So the context of turn k+1 is byte-for-byte the
context, output and observation of turn k, and the trainer sees the very tokens that were
sampled, even where re-rendering the history would differ (templates that drop earlier `<think>`
blocks).

Text that does not come from us (questions, pages, search results, summaries) is escaped so it
can never contain a special or added token of the tokenizer (`<|im_end|>`, `<tool_call>`,
`</tool_response>`, …): a page cannot close the tool-response turn and speak as the assistant.
Every tokenized piece of untrusted text is checked for such ids (`UnsafeTextError`). Clipping
comes after escaping and counts the escaped text's tokens: escaping lengthens text (one
`<|im_end|>` id becomes a dozen), so a limit counted before it would not bound what the model
is fed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_rl.agents.formats import ChatFamily, chat_family
from megatron_rl.utils.tokens import is_markup

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
GENERATION_PROMPT = f"{IM_START}assistant\n"
TRUNCATED = " …[truncated]"
_SURROGATE = re.compile("[\ud800-\udfff]")


class UnsafeTextError(AssertionError):
    """Escaped text still tokenized to a special/added token id (an escaping bug, never data)."""


class ChatFormat:
    """Tokenizer-bound prompt building for ChatML chat templates that take `tools` (Qwen3,
    Qwen3.5); `family` (`auto`: from the template) says how tool responses are written."""

    def __init__(self, tokenizer: Any, *, chat_template_kwargs: dict[str, Any] | None = None,
                 family: str | ChatFamily = "auto"):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.family = chat_family(family, tokenizer) if isinstance(family, str) else family
        ids = tokenizer.convert_tokens_to_ids([IM_START, IM_END])
        unk = getattr(tokenizer, "unk_token_id", None)
        if any(i is None or i == unk for i in ids):
            raise ValueError(f"tokenizer has no {IM_START}/{IM_END} tokens: not a ChatML tokenizer")
        self.im_start_id, self.im_end_id = ids
        # every token the tokenizer maps from a literal string ahead of the model's vocabulary
        # that is markup (special, or `<…>`: `<tool_call>`, `<think>`); added words (page
        # titles, URLs: `data tokenizer --title-tokens`) are content and stay as they are
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()
                 if t.special or is_markup(t.content)}
        for i in tokenizer.all_special_ids:
            added.setdefault(i, tokenizer.convert_ids_to_tokens(i))
        self.protected_ids: frozenset[int] = frozenset(added)
        self._protected = sorted({s for s in added.values() if s}, key=len, reverse=True)
        special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
        # the tokens that delimit turns: what the data's own system/assistant text may not hold
        self._special = sorted({s for s in special | set(tokenizer.all_special_tokens) if s},
                               key=len, reverse=True)
        self.generation_prompt = self._generation_prompt()
        # Qwen3.5's generation prompt opens the think block: the output starts inside it
        gp = self.generation_prompt
        self.think_prefix = "<think>" if gp.rfind("<think>") > gp.rfind("</think>") else ""
        self.truncated_ids = self.encode(TRUNCATED)
        # no vocabulary token spans more characters: text longer than max_tokens * this always
        # has more than max_tokens tokens, so clip() may drop the rest before tokenizing
        self._max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1)

    def _generation_prompt(self) -> str:
        """What the template appends for the assistant to speak (`<|im_start|>assistant\n`, plus
        Qwen3's empty think block with enable_thinking=False); reused after every observation."""
        msgs = [{"role": "user", "content": "x"}]
        with_prompt, without = (self.tokenizer.apply_chat_template(
            msgs, add_generation_prompt=g, tokenize=False, **self.template_kwargs)
            for g in (True, False))
        if not with_prompt.startswith(without) or IM_START not in with_prompt[len(without):]:
            return GENERATION_PROMPT
        return with_prompt[len(without):]

    # -- tokens ----------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def escape(self, text: str, tokens: Sequence[str] | None = None) -> str:
        """Break every literal occurrence of a special/added token in untrusted text (of
        `tokens`, longest first, when given).

        `<|im_end|>` becomes `&lt;|im_end|>` (readable, and no token matches it any more);
        tokens that do not start with `<` get a zero-width space after their first character.
        Repeated until stable, since a replacement could in principle form another token.
        Lone surrogates (not Unicode: tokenizers refuse them) become U+FFFD.
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = _SURROGATE.sub("\ufffd", text)
        for _ in range(8):
            found = [s for s in (self._protected if tokens is None else tokens) if s in text]
            if not found:
                return text
            for s in found:
                text = text.replace(s, "&lt;" + s[1:] if s[0] == "<" else s[0] + "\u200b" + s[1:])
        return text

    def safe_ids(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Escaped, tokenized untrusted text, then clipped to at most `max_tokens` ids (marker
        included); checked free of special ids."""
        return self.clip_ids(self._escaped(text, max_tokens)[1], max_tokens)

    def safe_text(self, text: str, max_tokens: int | None = None) -> str:
        """The same, as text, for untrusted pieces of a prompt rendered by the template (it
        tokenizes on its own to at most `max_tokens` ids)."""
        escaped, ids = self._escaped(text, max_tokens)
        if max_tokens is None or len(ids) <= max_tokens:
            return escaped
        clipped = self._clip_text(escaped, ids, max_tokens)
        self._checked(clipped)
        return clipped

    def _checked(self, escaped: str) -> list[int]:
        ids = self.encode(escaped)
        bad = sorted(set(ids) & self.protected_ids)
        if bad:
            raise UnsafeTextError(f"escaped text still holds special token ids {bad} "
                                  f"({self.tokenizer.convert_ids_to_tokens(bad)})")
        return ids

    def _escaped(self, text: str, max_tokens: int | None) -> tuple[str, list[int]]:
        """Escaped text and its checked ids. With a limit, text past what can survive clipping
        is dropped first, so a huge page is not tokenized whole."""
        if max_tokens is not None and len(text) > (max_tokens + 1) * self._max_token_chars:
            cut = self.escape(text[:(max_tokens + 1) * self._max_token_chars])
            ids = self._checked(cut)
            if len(ids) > max_tokens:
                return cut, ids
            # fewer tokens than characters allow: a tokenizer that drops text; no shortcut
        escaped = self.escape(text)
        return escaped, self._checked(escaped)

    def _whole_chars(self, ids: list[int], n: int) -> int:
        """The largest k <= n such that ids[:k] does not end inside a UTF-8 character (byte-level
        tokens can split one); n if backing off 3 ids does not get there."""
        for k in range(n, max(n - 4, 0), -1):
            if not self.decode(ids[max(k - 8, 0):k]).endswith("\ufffd"):
                return k
        return n

    def clip_ids(self, ids: list[int], max_tokens: int | None) -> list[int]:
        """At most `max_tokens` ids: a prefix of `ids`, then the ` …[truncated]` marker."""
        if max_tokens is None or len(ids) <= max_tokens:
            return ids
        keep = self._whole_chars(ids, max(max_tokens - len(self.truncated_ids), 0))
        return (ids[:keep] + self.truncated_ids)[:max_tokens]

    def clip(self, text: str, max_tokens: int | None) -> str:
        """Cut text so that it tokenizes to at most `max_tokens` ids (marker included), so one
        page cannot fill the context."""
        if max_tokens is None:
            return text
        ids = self.encode(text)
        return text if len(ids) <= max_tokens else self._clip_text(text, ids, max_tokens)

    def _clip_text(self, text: str, ids: list[int], max_tokens: int) -> str:
        keep = max(max_tokens - len(self.truncated_ids), 0)
        while keep > 0:  # a re-tokenized prefix may merge differently at the cut: shrink to fit
            keep = self._whole_chars(ids, keep)
            clipped = self.decode(ids[:keep]) + TRUNCATED
            over = len(self.encode(clipped)) - max_tokens
            if over <= 0:
                return clipped
            keep -= over
        return TRUNCATED if len(self.truncated_ids) <= max_tokens else ""

    # -- prompts ---------------------------------------------------------------------------------

    def prompt_ids(self, system: str, user: str, tools: list[dict[str, Any]] | None = None
                   ) -> list[int]:
        """The first context: system (+ tools), user, generation prompt.

        Untrusted pieces of `user` must come through `safe_text`; our own markup around them
        (e.g. the `<tool_response>` tags of IterSynth's evidence) stays tokens.
        """
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        text = self.tokenizer.apply_chat_template(messages, tools=tools or None,
                                                  add_generation_prompt=True, tokenize=False,
                                                  **self.template_kwargs)
        return self.encode(text)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], system: str = "",
                 tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The first context from the data's own chat (verl's `prompt` column), rendered by the
        template as the data says it.

        - `system` (the agent's own prompt) is put first only when the chat has no system
          message: the data's system prompt wins.
        - `tools` are passed to the template unless the chat's system prompt already defines
          them (holds a `<tools>` block): the data's own definitions, not a second list.
        - User and tool turns are untrusted like a question (`safe_text`); system and assistant
          turns are the data's instructions and demonstrations: they keep tool and think tags,
          only turn-delimiting tokens (`<|im_end|>`, …) are broken.
        Only `role` and `content` are used.
        """
        msgs = [{"role": str(m["role"]), "content": (
            self.safe_text(str(m["content"])) if m["role"] in ("user", "tool")
            else self.escape(str(m["content"]), self._special))} for m in messages]
        if system and (not msgs or msgs[0]["role"] != "system"):
            msgs.insert(0, {"role": "system", "content": system})
        if msgs and msgs[0]["role"] == "system" and "<tools>" in msgs[0]["content"]:
            tools = None
        text = self.tokenizer.apply_chat_template(msgs, tools=tools or None,
                                                  add_generation_prompt=True, tokenize=False,
                                                  **self.template_kwargs)
        return self.encode(text)

    def tool_response(self, content: str, max_tokens: int | None = None) -> list[int]:
        """One `<tool_response>` block (both families: newline, tags on their own lines; the
        content as the family's template writes it, then escaped and clipped)."""
        return (self.encode("\n<tool_response>\n")
                + self.safe_ids(self.family.response_content(content), max_tokens)
                + self.encode("\n</tool_response>"))

    def observation_ids(self, output_ids: Sequence[int], contents: Sequence[str],
                        max_tokens: int | None = None) -> list[int]:
        """What follows an assistant output: the tool responses as one user turn, then the next
        generation prompt. An output that did not end its turn with `<|im_end|>` (cut, or stopped
        on another token) is closed first, exactly as the chat template would have closed it."""
        closed = bool(output_ids) and output_ids[-1] == self.im_end_id
        ids = self.encode(("\n" if closed else IM_END + "\n") + IM_START + "user")
        for content in contents:
            ids += self.tool_response(content, max_tokens)
        return ids + self.encode(IM_END + "\n" + self.generation_prompt)
