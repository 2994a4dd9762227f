"""What a tokenizer's added tokens are: markup (special, or `<…>`: `<tool_call>`, `<think>`),
which untrusted text must never produce, or added words (page titles, URLs, URL prefixes:
`data tokenizer --title-tokens`), which are content."""

from __future__ import annotations

from typing import Any


def is_markup(token: str) -> bool:
    return token.startswith("<") and token.endswith(">") and len(token) > 2


def added_word_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the added whole words: neither special nor markup, nor a prefix (a URL's part
    before its title, added to match inside a word)."""
    return frozenset(i for i, t in tokenizer.added_tokens_decoder.items()
                     if not t.special and not is_markup(t.content) and t.single_word)
