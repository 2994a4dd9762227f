"""What a tokenizer's added tokens are: markup (special, or `<…>`: `<tool_call>`, `<think>`),
which untrusted text must never produce, or added words (page titles, URLs, URL prefixes:
`data tokenizer --title-tokens`), which are content. And how far two id sequences agree."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def is_markup(token: str) -> bool:
    return token.startswith("<") and token.endswith(">") and len(token) > 2


def added_word_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the added whole words: neither special nor markup, nor a prefix (a URL's part
    before its title, added to match inside a word)."""
    return frozenset(i for i, t in tokenizer.added_tokens_decoder.items()
                     if not t.special and not is_markup(t.content) and t.single_word)


def shared_prefix_length(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """How many ids `a` and `b[start:]` share from their starts (lists or tuples). Slices
    compare in C: an agent turn's context extends the last one by thousands of ids, which a
    loop over the ids walked at ~0.2 us an id; where they part, halving windows find it in
    ~len compares. A list and a tuple never compare equal: `b` is taken as `a`'s type."""
    m = min(len(a), len(b) - start)
    if m <= 0:
        return 0
    b = b[start:start + m]
    if type(b) is not type(a):
        b = type(a)(b)
    if a[:m] == b:
        return m
    lo, hi = 0, m - 1  # the first id they differ at lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
