"""Cached prompt prefixes for the embedded engine: which prefix of a prompt runs from cache.

SGLang keeps a radix tree of every request's KV. Agents need two parts of that:
- **Shared openings.** Every IterSynth Planner prompt opens with the same system prompt (176 of
  its ~230 tokens in the quickstart's RL); the samples of a group repeat the question. Each
  prompt is compared with the last `recent` ones: a run it shares with one of them, at least
  `min_tokens` longer than the longest cached prefix it has, is cached (its KV computed after
  that one's).
- **Continuations.** A ReAct turn's prompt is the last turn's prompt, its output and the tool's
  answer: a finished request's KV (prompt and output) is kept, so the next turn runs only the
  new tokens.
The engine computes and stores the KV; this class decides and keeps entries within a byte
budget, least recently used out first (finished requests before shared openings). Weight
updates clear it, recent prompts included: a resumed run's fresh engine repeats the uninterrupted
one's. The longest cached prefix of a prompt is found by walking a token trie of
the entries' keys, in the tokens it matches, whatever the number of entries.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from megatron_rl.utils.tokens import shared_prefix_length

PREFIX_MIN_TOKENS = 32  # a shorter shared run costs a pass of its own for little
PREFIX_RECENT = 64
PREFIX_CACHE_BYTES = 256 << 20  # the tiny models' KV is 4 KB a token: ~65k tokens


def kv_bytes(kv: Any) -> int:
    """Bytes of a per-layer list of (keys, values) tensors."""
    return sum(t.numel() * t.element_size() for pair in kv for t in pair)


class _Node:
    """A radix-trie node: its edges by first token, (the edge's tokens, the node below), and
    the entry key that ends here."""

    __slots__ = ("edges", "key")

    def __init__(self, key: tuple[int, ...] | None = None) -> None:
        self.edges: dict[int, tuple[tuple[int, ...], _Node]] = {}
        self.key = key


class KeyTrie:
    """The cache's keys as a radix trie (runs of tokens no two keys part on are one edge):
    `longest` walks one prompt once. A node a token made ten thousand nodes for a cache of 40
    agent turns, whose freeing held a weight update's commit for ~1 ms; here a key adds at
    most two."""

    def __init__(self) -> None:
        self.root = _Node()

    def insert(self, key: tuple[int, ...]) -> None:
        node, i = self.root, 0
        while i < len(key):
            edge = node.edges.get(key[i])
            if edge is None:
                node.edges[key[i]] = (key[i:], _Node(key))
                return
            label, child = edge
            n = shared_prefix_length(label, key, i)  # an edge's thousands of ids: slices
            if n < len(label):  # the key parts from this edge inside it: split it there
                middle = _Node()
                middle.edges[label[n]] = (label[n:], child)
                node.edges[key[i]] = (label[:n], middle)
                child = middle
            node, i = child, i + n
        node.key = key

    def remove(self, key: tuple[int, ...]) -> None:
        path: list[tuple[_Node, int]] = []  # (node, the token of the edge taken from it)
        node, i = self.root, 0
        while i < len(key):
            label, child = node.edges[key[i]]
            path.append((node, key[i]))
            node, i = child, i + len(label)
        node.key = None
        if not node.edges and path:  # a leaf: gone with its edge
            node, token = path.pop()
            del node.edges[token]
        if node is not self.root and node.key is None and len(node.edges) == 1:
            parent, token = path[-1]  # a keyless node with one edge: merged into the one above
            (label, child), = node.edges.values()
            parent.edges[token] = (parent.edges[token][0] + label, child)

    def longest(self, toks: list[int]) -> tuple[int, ...]:
        """The longest key that is a prefix of `toks` and shorter than it; () for none."""
        best: tuple[int, ...] = ()
        node, i, limit = self.root, 0, len(toks) - 1
        while i < limit:
            edge = node.edges.get(toks[i])
            if edge is None:
                break
            label, node = edge
            j = i + len(label)
            if j > limit or tuple(toks[i:j]) != label:  # no key ends inside an edge
                break
            i = j
            if node.key is not None:
                best = node.key
        return best


class RecentPrompts:
    """The last `size` prompts as rows of one -1-padded matrix: the longest opening a prompt
    shares with any of them is one comparison over the matrix (a loop over the rows took
    3x as long at 64 prompts of 150-1,500 tokens)."""

    def __init__(self, size: int):
        self.size, self.count, self.next = size, 0, 0
        self.rows = np.full((size, 64), -1, dtype=np.int64)

    def __len__(self) -> int:
        return self.count

    def clear(self) -> None:
        self.count = self.next = 0

    def longest_shared(self, arr: np.ndarray) -> int:
        """The longest run `arr` shares from its start with one of the prompts."""
        width = min(len(arr), self.rows.shape[1])
        if not self.count or not width:
            return 0
        # a row's padding (-1, never a token) ends its match at its own length
        differ = self.rows[:self.count, :width] != arr[:width]
        return int(np.where(differ.any(1), differ.argmax(1), width).max())

    def add(self, arr: np.ndarray) -> None:
        if len(arr) > self.rows.shape[1]:
            grown = np.full((self.size, max(len(arr), 2 * self.rows.shape[1])), -1,
                            dtype=np.int64)
            grown[:, :self.rows.shape[1]] = self.rows
            self.rows = grown
        row = self.rows[self.next]
        row[:len(arr)] = arr
        row[len(arr):] = -1
        self.next = (self.next + 1) % self.size
        self.count = min(self.count + 1, self.size)


class PrefixCache:
    def __init__(self, min_tokens: int = PREFIX_MIN_TOKENS, recent: int = PREFIX_RECENT,
                 max_bytes: int = PREFIX_CACHE_BYTES):
        self.min_tokens, self.max_bytes = min_tokens, max_bytes
        # token prefix -> per-layer (keys, values) [1, heads, len, dim]
        self.shared_runs: collections.OrderedDict[tuple[int, ...], Any] = (
            collections.OrderedDict())
        self.finished: collections.OrderedDict[tuple[int, ...], Any] = collections.OrderedDict()
        self.recent = RecentPrompts(recent)
        self.keys = KeyTrie()  # both pools' keys
        self.bytes = 0
        self.hits = 0          # prompts that took a cached prefix
        self.tokens_saved = 0  # prompt tokens those prefixes covered
        self.tokens_computed = 0  # tokens run to build shared entries

    def clear(self) -> None:
        """Drop every entry and the recent prompts: the next prompts start cold, as in a fresh
        engine (which runs get cached decides how a prompt's KV is split, and so rounded)."""
        self.shared_runs.clear()
        self.finished.clear()
        self.keys = KeyTrie()
        self.bytes = 0
        self.recent.clear()

    def _pool(self, key: tuple[int, ...]) -> collections.OrderedDict:
        return self.shared_runs if key in self.shared_runs else self.finished

    def longest(self, toks: list[int]) -> tuple[int, ...]:
        """The longest cached prefix of `toks` that leaves at least one token to run (its logits
        are the next token's); () for none."""
        return self.keys.longest(toks)

    def shared(self, toks: list[int]) -> int:
        """The longest run `toks` shares from its start with a recent prompt, at most
        len(toks) - 1; then `toks` becomes a recent prompt."""
        arr = np.asarray(toks, dtype=np.int64)
        best = self.recent.longest_shared(arr)
        self.recent.add(arr)
        return min(best, len(toks) - 1)

    def plan(self, toks: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(cached prefix to use, new shared run to cache first or ()): the new one extends
        the cached one by at least `min_tokens` tokens."""
        have = self.longest(toks)
        n = self.shared(toks)
        if n >= len(have) + self.min_tokens:
            return have, tuple(toks[:n])
        return have, ()

    def add(self, key: tuple[int, ...], kv: Any, finished: bool = False) -> bool:
        """Keep `kv` for `key` (a shared run, or a finished request's tokens); False where it
        alone exceeds the budget."""
        size = kv_bytes(kv)
        if size > self.max_bytes:
            return False
        pool = self.finished if finished else self.shared_runs
        if key in self.shared_runs or key in self.finished:
            self.bytes -= kv_bytes(self._pool(key).pop(key))
        else:
            self.keys.insert(key)
        pool[key] = kv
        self.bytes += size
        while self.bytes > self.max_bytes:
            old = self.finished if self.finished else self.shared_runs
            gone, kv_gone = old.popitem(last=False)
            self.keys.remove(gone)
            self.bytes -= kv_bytes(kv_gone)
        return True

    def kv(self, key: tuple[int, ...]) -> Any:
        return self._pool(key)[key]

    def get(self, key: tuple[int, ...]) -> Any:
        """An entry's KV, for one prompt (counted, marked used)."""
        pool = self._pool(key)
        pool.move_to_end(key)
        self.hits += 1
        self.tokens_saved += len(key)
        return pool[key]

    def info(self) -> dict[str, Any]:
        return {"shared_runs": len(self.shared_runs), "finished": len(self.finished),
                "bytes": self.bytes, "hits": self.hits, "tokens_saved": self.tokens_saved,
                "tokens_computed": self.tokens_computed}
