"""The prefix cache's key index (`engines.prefix_cache.KeyTrie`, a radix trie): after any
sequence of inserts and removals, `longest` is the longest key that is a proper prefix of the
query (checked against a scan of every key), and the trie holds at most two nodes a key."""

from __future__ import annotations

import random

from megatron_rl.engines.prefix_cache import KeyTrie


def _nodes(trie: KeyTrie) -> int:
    todo, n = [trie.root], 0
    while todo:
        node = todo.pop()
        n += 1
        todo += [child for _, child in node.edges.values()]
    return n


def _longest(keys: set[tuple[int, ...]], query: list[int]) -> tuple[int, ...]:
    fits = [k for k in keys if len(k) < len(query) and tuple(query[:len(k)]) == k]
    return max(fits, key=len, default=())


def test_longest_matches_a_scan_of_the_keys_through_inserts_and_removals() -> None:
    rng = random.Random(0)
    checked = 0
    for _ in range(200):
        trie, keys = KeyTrie(), set()
        alphabet = rng.choice([2, 3, 5])  # few tokens: keys part inside edges, nest, repeat
        for _ in range(rng.randint(1, 50)):
            if keys and rng.random() < 0.35:
                key = rng.choice(sorted(keys))
                keys.remove(key)
                trie.remove(key)
            else:
                key = tuple(rng.randrange(alphabet) for _ in range(rng.randint(1, 12)))
                if key not in keys:
                    keys.add(key)
                    trie.insert(key)
            for _ in range(4):
                query = [rng.randrange(alphabet) for _ in range(rng.randint(0, 14))]
                assert trie.longest(query) == _longest(keys, query), (sorted(keys), query)
                checked += 1
            assert _nodes(trie) <= 2 * len(keys) + 1
    assert checked > 10_000


def test_agent_turns_share_one_edge_for_their_common_opening() -> None:
    system = tuple(range(100, 300))  # 200 tokens every turn opens with
    trie = KeyTrie()
    turns = [system + tuple(range(1000 * i, 1000 * i + 50)) for i in range(1, 41)]
    for key in turns:
        trie.insert(key)
    assert _nodes(trie) == 1 + 1 + 40  # root, the opening, one leaf a turn
    assert trie.longest([*turns[7], 5]) == turns[7]
    assert trie.longest(list(turns[7])) == ()  # a key must leave a token to run
    assert trie.longest([*system, 1]) == ()
    trie.insert(system)  # a key ending where the edges part
    assert trie.longest([*system, 1]) == system
    for key in turns:
        trie.remove(key)
    assert _nodes(trie) == 2 and trie.longest([*turns[0], 5]) == system
