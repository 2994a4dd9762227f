"""The pruned local search (rare clauses pick the candidates, common ones only score them) gives
exactly what the full BM25 query gives: same pages, order, titles, snippets and scores."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.data.world import build_world_index, generate_world
from megatron_rl.env.index import COMMON_SHARE, SearchIndex, build_index

DOCS = 3000
EDGE_QUERIES = ["born", "born city", "the of which", "The Who", "founder founder network",
                "run running runs", "foo_bar network", "x" * 500, "ß ü 北京", "capital",
                "In which city", "university founded year", "AND OR NOT", "?!"]


@pytest.fixture(scope="module")
def world():
    return generate_world(DOCS, seed=13)


@pytest.fixture(scope="module")
def index_dir(world, tmp_path_factory):
    return build_world_index(world, tmp_path_factory.mktemp("speed_index"))


def _full_only(path) -> SearchIndex:
    ref = SearchIndex(path)
    ref._pruned = lambda words: None  # the full query every time: the unpruned reference
    return ref


def _same(a, b) -> bool:
    return ([(h.url, h.title, h.snippet) for h in a] == [(h.url, h.title, h.snippet) for h in b]
            and all(math.isclose(x.score, y.score, rel_tol=1e-5) for x, y in zip(a, b)))


@pytest.mark.parametrize("top_k", [1, 5, 20])
def test_pruned_search_equals_full_query(world, index_dir, top_k):
    index, ref = SearchIndex(index_dir), _full_only(index_dir)
    queries = [q.question for q in world.questions(150, seed=3)] + EDGE_QUERIES
    for q in queries:
        got, want = index.search(q, top_k), ref.search(q, top_k)
        assert _same(got, want), (q, [h.url for h in got], [h.url for h in want])


def test_common_words_are_pruned_for_typical_questions(world, index_dir, monkeypatch):
    index = SearchIndex(index_dir)
    full_calls = []
    real_full = index._full
    monkeypatch.setattr(index, "_full", lambda words: full_calls.append(words) or
                        real_full(words))
    qs = world.questions(100, seed=4)
    for q in qs:
        assert q.support[0] in [h.url for h in index.search(q.question, 5)], q.question
    # the full query runs only where the bound cannot rule out a page outside the candidates
    assert len(full_calls) <= 0.25 * len(qs), len(full_calls)


def test_a_page_with_common_words_only_still_wins_when_it_should(tmp_path):
    # "apple" is on most pages (common), "zyx" on one: the candidates ("zyx" pages) are fewer
    # than top_k, so the common-only pages must come from the full query
    rows = [{"url": f"u{i}", "title": f"page {i}", "text": "apple " * (1 + i % 5) + "filler"}
            for i in range(100)]
    rows.append({"url": "rare", "title": "rare page", "text": "zyx apple"})
    assert 60 > COMMON_SHARE * len(rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    build_index(tmp_path / "c.parquet", tmp_path / "idx", progress=False)
    index, ref = SearchIndex(tmp_path / "idx"), _full_only(tmp_path / "idx")
    got = index.search("apple zyx", 5)
    assert _same(got, ref.search("apple zyx", 5))
    assert got[0].url == "rare" and len(got) == 5
    assert _same(index.search("apple", 5), ref.search("apple", 5))


def test_stop_word_only_queries_answer_or_say_empty(index_dir):
    index = SearchIndex(index_dir)
    assert index.search("?!", 5) == []
    hits = index.search("Who is the", 5)  # stop words only: kept, so still a query
    assert isinstance(hits, list) and all(h.url for h in hits)
    assert _same(hits, _full_only(index_dir).search("Who is the", 5))
