"""The generated world, the tantivy index (build, errors, ranking) and local search + visit."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.cli import main as cli_main
from megatron_rl.data.world import build_world_index, generate_world, write_corpus
from megatron_rl.env.base import Tool, ToolResult, tool_spec, validate_arguments
from megatron_rl.env.index import CorpusError, IndexOpenError, SearchIndex, build_index
from megatron_rl.env.search import LocalSearch
from megatron_rl.env.visit import ExtractiveSummarizer, LocalPages, Visit

DOCS = 3000


@pytest.fixture(scope="module")
def world():
    return generate_world(DOCS, seed=7)


@pytest.fixture(scope="module")
def index_dir(world, tmp_path_factory) -> Path:
    return build_world_index(world, tmp_path_factory.mktemp("env_index"))


@pytest.fixture(scope="module")
def index(index_dir) -> SearchIndex:
    return SearchIndex(index_dir)


# -- world ----------------------------------------------------------------------------------------

def test_world_is_deterministic_and_sized():
    a, b = generate_world(500, seed=3), generate_world(500, seed=3)
    pa_, pb = list(a.pages()), list(b.pages())
    assert pa_ == pb and len(pa_) == 500 == len(a)
    assert len({p["url"] for p in pa_}) == 500, "one page per URL"
    assert a.questions(12, seed=1) == b.questions(12, seed=1)
    assert list(generate_world(500, seed=4).pages()) != pa_


def test_world_10k_docs_in_seconds():
    t0 = time.perf_counter()
    pages = list(generate_world(10_000, seed=0).pages())
    elapsed = time.perf_counter() - t0
    assert len(pages) == 10_000
    assert elapsed < 10, f"10k pages took {elapsed:.1f}s"


def test_questions_are_answerable_from_their_support_pages(world):
    pages = {p["url"]: p for p in world.pages()}
    qs = world.questions(120, seed=5)
    assert len({q.kind for q in qs}) == 6
    for q in qs:
        assert all(u in pages for u in q.support), q
        # hop 1: the entity named in the question is the first page's title
        assert pages[q.support[0]]["title"] in q.question
        # each later page is named on the page before it, and the answer is on the last one
        for prev, nxt in zip(q.support, q.support[1:]):
            assert pages[nxt]["title"] in pages[prev]["text"], q
        assert q.answer in pages[q.support[-1]]["text"], q


# -- index build ----------------------------------------------------------------------------------

def test_supporting_page_ranks_in_top_k(world, index):
    assert index.num_docs == DOCS
    qs = world.questions(60, seed=11)
    ranks = []
    for q in qs:
        urls = [h.url for h in index.search(q.question, 5)]
        assert q.support[0] in urls, (q.question, urls)
        ranks.append(urls.index(q.support[0]))
    assert sum(r == 0 for r in ranks) >= 0.9 * len(ranks), ranks
    hit = index.search(qs[0].question, 1)[0]
    assert hit.title and 0 < len(hit.snippet) <= 260 and "\n" not in hit.snippet


def test_queries_with_syntax_never_raise(index):
    for q in ['"unbalanced', "title:foo (bar", "AND OR NOT", "the of which", "a:b:c", "?!",
              "x" * 500, "ß ü 北京"]:
        assert isinstance(index.search(q, 3), list)
    assert index.search("?!", 3) == []


def test_page_lookup(world, index):
    page = next(iter(world.pages()))
    got = index.page(page["url"])
    assert got is not None and got.text == page["text"] and got.title == page["title"]
    assert index.page(page["url"] + "/") is not None, "trailing slash forgiven"
    assert index.page("https://nowhere.test/x") is None
    # a world URL spells its title, spaces included; a wiki's other spellings find it too
    page = next(p for p in world.pages() if " " in p["title"])
    assert page["url"].endswith("/" + page["title"])
    for spelling in (page["url"].replace(" ", "_"), page["url"].replace(" ", "%20")):
        assert index.page(spelling).url == page["url"], spelling


def test_cli_build_jsonl_and_overwrite(tmp_path, capsys):
    world = generate_world(200, seed=1)
    write_corpus(world, tmp_path / "c.jsonl")
    out = tmp_path / "idx"
    assert cli_main(["search", "build", "--corpus", str(tmp_path / "c.jsonl"), "--out",
                     str(out), "--no-progress"]) == 0
    assert "200 docs" in capsys.readouterr().out
    first_id = SearchIndex(out).id
    assert cli_main(["search", "build", "--corpus", str(tmp_path / "c.jsonl"), "--out",
                     str(out), "--no-progress"]) == 2
    assert "exists" in capsys.readouterr().err
    assert cli_main(["search", "build", "--corpus", str(tmp_path / "c.jsonl"), "--out",
                     str(out), "--no-progress", "--overwrite"]) == 0
    assert SearchIndex(out).id != first_id and SearchIndex(out).num_docs == 200
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "idx"], "no temp folders"


def test_duplicate_urls_are_skipped(tmp_path):
    rows = [{"url": "u1", "title": "a", "text": "x"}, {"url": "u1", "title": "b", "text": "y"},
            {"url": "u2", "title": None, "text": "z"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    m = build_index(tmp_path / "c.parquet", tmp_path / "idx", progress=False)
    assert (m["docs"], m["duplicates_skipped"]) == (2, 1)
    assert SearchIndex(tmp_path / "idx").page("u1").title == "a"


def test_equal_scores_rank_by_url_whatever_the_build_order(tmp_path):
    """Two builds of one corpus (here: rows in opposite orders) rank the same pages: tantivy
    breaks BM25 ties by document address, which the build decides."""
    rows = [{"url": "https://w.test/Silurmouth", "title": "Silurmouth",
             "text": "Silurmouth is a city."}]
    rows += [{"url": f"https://w.test/p{i:02d}", "title": f"Person {i:02d}",
              "text": f"Born in Silurmouth in {1900 + i}."} for i in range(30)]
    rows += [{"url": f"https://w.test/f{i}", "title": f"Filler {i}", "text": "nothing here"}
             for i in range(200)]
    found = []
    for order, name in ((rows, "a"), (rows[::-1], "b")):
        pq.write_table(pa.Table.from_pylist(order), tmp_path / f"{name}.parquet")
        build_index(tmp_path / f"{name}.parquet", tmp_path / name, progress=False)
        ix = SearchIndex(tmp_path / name)
        found.append([(h.url, h.score) for h in ix.search("Silurmouth", top_k=3)])
    assert found[0] == found[1]
    urls, scores = zip(*found[0], strict=True)
    assert urls == ("https://w.test/Silurmouth", "https://w.test/p00", "https://w.test/p01")
    assert scores[1] == scores[2] < scores[0]  # the 30 person pages tie


@pytest.mark.parametrize("rows, needle", [
    ([{"url": "u", "title": "t"}], "missing column(s) ['text']"),
    ([{"url": 5, "title": "t", "text": "x"}], "row 0: column 'url' must be a string"),
    ([{"url": "u", "title": "t", "text": "x"}, {"url": " ", "title": "t", "text": "x"}],
     "row 1: column 'url' is empty"),
])
def test_bad_parquet_names_file_and_column(tmp_path, capsys, rows, needle):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert cli_main(["search", "build", "--corpus", str(path), "--out", str(tmp_path / "idx"),
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.parquet"], "nothing left behind"


def test_bad_jsonl_and_formats(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"url": "u", "title": "t", "text": "x"}) + "\n{oops\n")
    with pytest.raises(CorpusError, match=re.escape(f"{p}: line 2: not JSON")):
        build_index(p, tmp_path / "idx", progress=False)
    (tmp_path / "c.csv").write_text("url,title,text\n")
    with pytest.raises(CorpusError, match="unknown corpus format"):
        build_index(tmp_path / "c.csv", tmp_path / "idx", progress=False)
    with pytest.raises(CorpusError, match="no such corpus file"):
        build_index(tmp_path / "missing.parquet", tmp_path / "idx", progress=False)
    assert not (tmp_path / "idx").exists()
    with pytest.raises(IndexOpenError, match="not a search index"):
        SearchIndex(tmp_path)


def test_failed_rebuild_keeps_the_old_index(tmp_path):
    write_corpus(generate_world(100, seed=0), tmp_path / "good.jsonl")
    build_index(tmp_path / "good.jsonl", tmp_path / "idx", progress=False)
    (tmp_path / "bad.jsonl").write_text((tmp_path / "good.jsonl").read_text() + '{"url": 1}\n')
    with pytest.raises(CorpusError):
        build_index(tmp_path / "bad.jsonl", tmp_path / "idx", overwrite=True, progress=False)
    assert SearchIndex(tmp_path / "idx").num_docs == 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.jsonl", "idx"]


# -- tools over the local index -------------------------------------------------------------------

def test_arguments_are_validated():
    schema = LocalSearch.parameters
    assert validate_arguments(schema, {"query": "x"}) is None
    assert validate_arguments(schema, {"query": "x", "top_k": 3}) is None
    for bad in ({}, {"query": 3}, {"query": "   "}, {"query": "x", "top_k": "3"},
                {"query": "x", "top_k": True}, {"query": "x", "top_k": 0},
                {"query": "x", "top_k": 21}, {"query": "x", "k": 3}):
        assert validate_arguments(schema, bad) is not None, bad


def test_local_search_and_visit_answer_a_two_hop_question(world, index):
    search = LocalSearch(index)
    visit = Visit(LocalPages(index), ExtractiveSummarizer(max_chars=400))
    assert isinstance(search, Tool) and isinstance(visit, Tool)
    assert [tool_spec(t)["function"]["name"] for t in (search, visit)] == ["search", "visit"]
    assert tool_spec(search)["function"]["parameters"]["required"] == ["query"]
    q = next(q for q in world.questions(30, seed=2) if q.kind == "founder_birth_city")

    async def agent() -> list[ToolResult]:
        r1 = await search(query=q.question, top_k=3)
        r2 = await visit(url=r1.data[0]["url"], goal="who founded it")
        founder = re.search(r"founded in \d+ by ([^.]+)\.", r2.content).group(1)
        r3 = await search(query=founder)
        r4 = await visit(url=r3.data[0]["url"], goal="where was he born")
        return [r1, r2, r3, r4]

    results = asyncio.run(agent())
    assert all(r.ok and r.error is None and r.attempts == 1 for r in results), results
    assert results[0].data[0]["url"] == q.support[0]
    assert results[2].data[0]["url"] == q.support[1]
    assert f"born in {q.answer}" in results[3].content
    assert results[0].content.startswith(f"A search for '{q.question}' found 3 results:")


def test_bad_arguments_and_visit_failures_are_labelled(index):
    search, visit = LocalSearch(index), Visit(LocalPages(index))

    async def calls() -> list[ToolResult]:
        out = [await search(q="x"), await search(query=""),
               await visit(url="https://nowhere.test/", goal="g")]
        await visit.close()
        return out

    rs = asyncio.run(calls())
    assert [r.error for r in rs] == ["bad_arguments", "bad_arguments", "visit_error"]
    assert all(not r.ok and r.content.startswith("[") for r in rs)
    assert "unknown argument(s) ['q']" in rs[0].detail
    assert "no page at https://nowhere.test/" in rs[2].detail


def test_extractive_summarizer_keeps_goal_passages():
    paras = [f"Paragraph {i} talks about weather and rivers. " * 4 for i in range(30)]
    paras[17] = "Kalo Mirtan was born in Zorvexton in 1950."
    text = "\n\n".join(paras)
    out = ExtractiveSummarizer(max_chars=500).extract(text, "Where was Kalo Mirtan born?")
    assert len(out) <= 500 and "born in Zorvexton" in out
    assert out.startswith("Paragraph 0"), "the opening passage is kept when there is room"
    short = ExtractiveSummarizer(max_chars=500).extract("one\n\ntwo", "")
    assert short == "one\n\ntwo"
    huge = ExtractiveSummarizer(max_chars=100, passage_chars=1000).extract("word " * 500, "x")
    assert len(huge) <= 102 and huge.endswith("…")
