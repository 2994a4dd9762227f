"""The generated world: determinism, scale, aliases, typed relations, hyperlinks, the CLI."""

from __future__ import annotations

import argparse
import json
import time

import pyarrow.parquet as pq
import pytest

from megatron_rl.data.world import (
    FORWARD,
    KINDS,
    RELATIONS,
    add_world_parser,
    generate_world,
    write_corpus,
)


@pytest.fixture(scope="module")
def world():
    return generate_world(1500, seed=5)


def test_same_seed_same_pages_relations_and_questions():
    a, b = generate_world(800, seed=9), generate_world(800, seed=9)
    assert list(a.pages()) == list(b.pages())
    assert list(a.relations()) == list(b.relations())
    assert a.questions(20, seed=2) == b.questions(20, seed=2)
    assert [a.aliases(e) for e in range(len(a))] == [b.aliases(e) for e in range(len(b))]
    assert list(generate_world(800, seed=10).pages()) != list(a.pages())


def test_1e5_pages_generate_fast():
    t0 = time.perf_counter()
    world = generate_world(100_000, seed=0)
    n = links = 0
    for page in world.pages():
        n += 1
        links += len(page["links"])
    elapsed = time.perf_counter() - t0
    print(f"\n10^5 pages ({links} links) in {elapsed:.1f}s")
    assert n == 100_000 == len(world)
    assert elapsed < 45, f"10^5 pages took {elapsed:.1f}s"


def test_entity_ids_kinds_and_attributes(world):
    assert [world.kind(world.ids(k)[0]) for k in KINDS] == list(KINDS)
    assert sum(len(world.ids(k)) for k in KINDS) == len(world)
    for eid in (0, len(world) // 2, len(world) - 1):
        kind, i = world.locate(eid)
        assert world.eid(kind, i) == eid and world.by_url(world.url_of(eid)) == eid
        assert world.attrs(eid) and all(isinstance(k, str) for k in world.attrs(eid))
    with pytest.raises(IndexError, match="entity id"):
        world.locate(len(world))


def test_every_entity_has_aliases_on_its_page(world):
    pages = list(world.pages())
    for eid in range(0, len(world), 7):
        aka = world.aliases(eid)
        assert aka and world.name(eid) not in aka, world.name(eid)
        assert all(a in pages[eid]["text"] for a in aka), (aka, pages[eid]["text"][:200])


def test_relations_are_typed_and_stated_on_the_pages(world):
    pages = {p["url"]: p for p in world.pages()}
    triples = list(world.relations())
    assert {r for _, r, _ in triples} == set(FORWARD)
    for src, rel, dst in triples:
        r = RELATIONS[rel]
        assert (world.kind(src), world.kind(dst)) == (r.src, r.dst), (rel, src, dst)
        # each edge is readable backwards, and its object is named on the subject's page
        assert (r.inverse, src) in world.neighbors(dst) or rel == "capital"
        assert world.name(dst) in pages[world.url_of(src)]["text"]
    for rel, r in RELATIONS.items():
        assert RELATIONS[r.inverse].inverse == rel and RELATIONS[r.inverse].src == r.dst


def test_pages_carry_hyperlinks_to_the_entities_they_mention(world):
    urls = {p["url"] for p in world.pages()}
    n = 0
    for p in world.pages():
        assert p["links"] and len(set(p["links"])) == len(p["links"])
        for link in p["links"]:
            assert link in urls and link != p["url"]
            assert f"<{link}>" in p["text"], "the link is visible on the page"
            n += 1
    assert n > 2 * len(world), f"{n} links: cities and universities link their people too"


def test_functional_relations_have_one_object(world):
    for eid in range(len(world)):
        rels = [r for r, _ in world.neighbors(eid)]
        for rel in set(rels):
            if RELATIONS[rel].functional:
                assert rels.count(rel) == 1, (world.name(eid), rel)


def test_world_subcommand_writes_corpus_graph_and_index(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    add_world_parser(sub)
    args = parser.parse_args(["world", "--pages", "300", "--seed", "1", "--out",
                              str(tmp_path / "c.parquet"), "--graph", str(tmp_path / "g.jsonl"),
                              "--index", str(tmp_path / "idx")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "300 pages" in out and "relations" in out
    table = pq.read_table(tmp_path / "c.parquet")
    assert table.num_rows == 300 and table.column_names == ["url", "title", "text", "links"]
    rows = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    world = generate_world(300, seed=1)
    assert len(rows) == sum(1 for _ in world.relations())
    assert set(rows[0]) == {"subject", "relation", "object"}
    assert (tmp_path / "idx" / "manifest.json").is_file()


def test_jsonl_corpus_keeps_links(tmp_path):
    world = generate_world(100, seed=0)
    assert write_corpus(world, tmp_path / "c.jsonl") == 100
    first = json.loads((tmp_path / "c.jsonl").read_text().splitlines()[0])
    assert first["links"] == next(world.pages())["links"]
