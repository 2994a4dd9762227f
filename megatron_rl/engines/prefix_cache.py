"""Shared prompt prefixes for the embedded engine: which prefix of a prompt to take from cache.

Agents send many prompts that start alike: every IterSynth Planner prompt opens with the same
system prompt (176 of its ~230 tokens in the quickstart's RL), the samples of a group repeat
the question. SGLang keeps a radix tree of every prompt's KV; this keeps what such prompts
share, found by comparing each prompt with the last `recent` ones: a prefix shared with one of
them, at least `min_tokens` longer than the longest cached prefix of the prompt, is cached
(its KV extends that one's). The engine computes and stores the KV; this class only decides
and keeps entries (least recently used first out). Weight updates clear it.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

PREFIX_MIN_TOKENS = 32  # a shorter shared run costs a pass of its own for little
PREFIX_ENTRIES = 64
PREFIX_RECENT = 64


class PrefixCache:
    def __init__(self, min_tokens: int = PREFIX_MIN_TOKENS, max_entries: int = PREFIX_ENTRIES,
                 recent: int = PREFIX_RECENT):
        self.min_tokens, self.max_entries = min_tokens, max_entries
        self.entries: collections.OrderedDict[tuple[int, ...], Any] = collections.OrderedDict()
        self.recent: collections.deque[np.ndarray] = collections.deque(maxlen=recent)
        self.hits = 0          # prompts that took a cached prefix
        self.tokens_saved = 0  # prompt tokens those prefixes covered
        self.tokens_computed = 0  # tokens run to build entries

    def clear(self, recent: bool = False) -> None:
        """Drop every entry (the weights changed: the recent prompts, tokens, stay valid), and
        with `recent` the recent prompts too (a flush: the next prompts start cold)."""
        self.entries.clear()
        if recent:
            self.recent.clear()

    def longest(self, toks: list[int]) -> tuple[int, ...]:
        """The longest cached prefix of `toks` that leaves at least one token to run (its logits
        are the next token's); () for none."""
        best: tuple[int, ...] = ()
        for key in self.entries:
            if len(best) < len(key) < len(toks) and tuple(toks[:len(key)]) == key:
                best = key
        return best

    def shared(self, toks: list[int]) -> int:
        """The longest run `toks` shares from its start with a recent prompt, at most
        len(toks) - 1; then `toks` becomes a recent prompt."""
        arr = np.asarray(toks, dtype=np.int64)
        best = 0
        for other in self.recent:
            n = min(len(arr), len(other))
            diff = np.flatnonzero(arr[:n] != other[:n])
            best = max(best, int(diff[0]) if len(diff) else n)
        self.recent.append(arr)
        return min(best, len(toks) - 1)

    def plan(self, toks: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(cached prefix to use, new prefix to cache first or ()): the new one extends the
        cached one by at least `min_tokens` tokens."""
        have = self.longest(toks)
        n = self.shared(toks)
        if n >= len(have) + self.min_tokens:
            return have, tuple(toks[:n])
        return have, ()

    def add(self, key: tuple[int, ...], kv: Any) -> None:
        self.entries[key] = kv
        self.entries.move_to_end(key)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def get(self, key: tuple[int, ...]) -> Any:
        """An entry's KV, for one prompt (counted, marked used)."""
        self.entries.move_to_end(key)
        self.hits += 1
        self.tokens_saved += len(key)
        return self.entries[key]

    def info(self) -> dict[str, Any]:
        return {"entries": len(self.entries), "hits": self.hits,
                "tokens_saved": self.tokens_saved, "tokens_computed": self.tokens_computed,
                "cached_tokens": sum(map(len, self.entries))}
