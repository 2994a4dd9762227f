"""Web-graph QA synthesis (Iris): questions that can only be answered by searching and following
links, written as verl parquet.

Stages, each counted (`SynthesisResult.counts`, printed as progress):

1. graph: G = (V, E) from the pages and their out-links (`PageGraph`);
2. seeds: answer-anchored sampling: fix the answer entity, take the pages describing it (its
   own page and pages linking to it);
3. expansion: breadth-first along out-links into a subgraph of at most `max_pages` pages, each
   page's text cut to `text_budget` characters;
4. synthesis (`Synthesizer.generate`): entity-graph extraction (at most `max_entities`), a path
   of >= `min_hops` relations ending at the answer, a question along it, and anchor abstraction
   (every non-answer entity becomes a description without its name or aliases);
5. verification (`Synthesizer.verify`): `verify.RuleVerifier` for the embedded world,
   `verify.DualCriteriaVerifier` (plus text rules) for the LLM path;
6. output: train / held-out parquet split by answer entity (no answer in both).

Two synthesizers share the interface: `RuleSynthesizer` knows the world's relations and needs no
LLM; `LLMSynthesizer` asks any OpenAI-compatible endpoint (prompts in `configs/prompts/`, every
reply validated as JSON; an invalid one is a counted rejection, never a crash).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import time
import zlib
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.data.verify import (
    PROMPT_DIR,
    Anchor,
    Candidate,
    Constraint,
    DualCriteriaVerifier,
    RuleVerifier,
    Verdict,
    load_prompt,
    mentions,
    parse_json_object,
)
from megatron_rl.data.world import FORWARD, RELATIONS, World, generate_world
from megatron_rl.utils.chat_client import UNTRUSTED_NOTE, ChatClient, ClientConfig, quote_untrusted
from megatron_rl.utils.links import ANGLE_URL

# -- the page graph ---------------------------------------------------------------------------

_URL = re.compile(rf"<({ANGLE_URL})>")


@dataclass
class PageGraph:
    """Pages (url → (title, text)) and their out-links (url → urls, only to known pages)."""

    pages: dict[str, tuple[str, str]]
    links: dict[str, list[str]]
    _in: dict[str, list[str]] | None = field(default=None, repr=False)

    @classmethod
    def from_pages(cls, pages: Iterable[dict[str, Any]]) -> PageGraph:
        texts: dict[str, tuple[str, str]] = {}
        links: dict[str, list[str]] = {}
        for i, p in enumerate(pages):
            for col in ("url", "title", "text"):
                if not isinstance(p.get(col), str):
                    raise ValueError(f"page {i}: column {col!r} must be a string")
            out = p.get("links")
            if out is None:  # a corpus without a links column: the <url> targets in the text
                out = _URL.findall(p["text"])
            texts[p["url"]] = (p["title"], p["text"])
            links[p["url"]] = list(out)
        for url, out in links.items():
            links[url] = [u for u in dict.fromkeys(out) if u in texts and u != url]
        return cls(texts, links)

    @classmethod
    def from_corpus(cls, path: str | Path) -> PageGraph:
        from megatron_rl.data.parquet import iter_rows

        return cls.from_pages(row for _, row in iter_rows(Path(path)))

    @property
    def num_links(self) -> int:
        return sum(len(v) for v in self.links.values())

    def in_links(self, url: str) -> list[str]:
        if self._in is None:
            self._in = {}
            for src, out in self.links.items():
                for dst in out:
                    self._in.setdefault(dst, []).append(src)
        return self._in.get(url, [])

    def expand(self, seeds: Sequence[str], depth: int, max_pages: int) -> list[str]:
        """Breadth-first along out-links from `seeds`: at most `max_pages` URLs, `depth` hops."""
        seen = list(dict.fromkeys(seeds))[:max_pages]
        frontier = deque((u, 0) for u in seen)
        marked = set(seen)
        while frontier and len(seen) < max_pages:
            url, d = frontier.popleft()
            if d == depth:
                continue
            for nxt in self.links.get(url, []):
                if nxt not in marked:
                    marked.add(nxt)
                    seen.append(nxt)
                    frontier.append((nxt, d + 1))
                    if len(seen) == max_pages:
                        break
        return seen


@dataclass(frozen=True)
class Seed:
    """An answer page, the pages describing it, and the subgraph expanded from them."""

    answer_url: str
    describing: tuple[str, ...]
    subgraph: tuple[str, ...]
    texts: dict[str, tuple[str, str]]  # url → (title, text cut to the budget)


@dataclass(frozen=True)
class QA:
    """One kept question, as it is written out."""

    question: str
    answers: tuple[str, ...]  # the answer first, then accepted aliases
    answer_key: str           # the answer entity (the train / held-out split key)
    hops: int
    difficulty: int
    source: str
    kind: str
    support: tuple[str, ...]
    facts: tuple[str, ...]
    start_url: str            # the page of the path's first entity
    start_name: str | None = None  # a named anchor: the name the question gives it


class Synthesizer(ABC):
    """Turns a seed into a candidate question (or a rejection reason), and verifies it."""

    source: str

    @abstractmethod
    async def generate(self, seed: Seed, rng: random.Random) -> tuple[Any, str]:
        """(candidate, "") or (None, rejection reason)."""

    @abstractmethod
    async def verify(self, candidate: Any) -> Verdict: ...

    @abstractmethod
    def to_qa(self, candidate: Any) -> QA: ...


# -- rule-based, over the embedded world ------------------------------------------------------

_HEAD = {"country": "country", "city": "city", "university": "university",
         "company": "company", "person": "person"}
_WHICH = {"country": "Which country", "city": "Which city", "university": "Which university",
          "company": "Which company", "person": "Who"}
# how a hop x -r-> y names y from the phrase for x
_STEP = {
    "capital": "the capital of {x}", "capital_of": "the country whose capital is {x}",
    "located_in": "the country where {x} lies", "has_city": "the {y} in {x}",
    "campus_in": "the city where {x} is located", "has_university": "the {y} in {x}",
    "headquartered_in": "the city where {x} is headquartered",
    "headquarters_of": "the {y} headquartered in {x}", "founded_by": "the founder of {x}",
    "founder_of": "the {y} founded by {x}", "born_in": "the birthplace of {x}",
    "birthplace_of": "the {y} born in {x}", "studied_at": "the university attended by {x}",
    "alumnus": "the {y} who studied at {x}",
}
# how an anchor relates to an entity given by one attribute
_LINK = {"capital": "whose capital is", "capital_of": "which is the capital of",
         "located_in": "located in", "campus_in": "located in",
         "headquartered_in": "headquartered in", "founded_by": "founded by",
         "born_in": "born in", "studied_at": "who studied at"}


def describe(kind: str, quals: Sequence[Constraint], article: str = "the") -> str:
    """'the shipping company (founded 1950)' from a kind and attribute constraints."""
    head, extra = _HEAD[kind], []
    for attr, v in quals:
        if attr in ("occupation", "industry", "type"):
            head = v if attr != "industry" else f"{v} company"
        elif attr == "founded":
            extra.append(f"founded {v}")
        elif attr == "birth_year":
            extra.append(f"born {v}")
        elif attr == "region":
            extra.append(f"in {v}")
    if article == "a" and head[0] in "aeio":  # "a university", "an engineer"
        article = "an"
    return f"{article} {head}" + (f" ({', '.join(extra)})" if extra else "")


def render_question(kind_of: Callable[[int], str], c_path: Sequence[int], anchor: Anchor,
                    relations: Sequence[str], qualifiers: Sequence[Sequence[Constraint]]) -> str:
    if anchor.name is not None:
        np = anchor.name
    else:
        np = describe(anchor.kind, anchor.attrs)
    clauses = [f"{_LINK[rel]} {describe(RELATIONS[rel].dst, [(attr, v)], 'a')}"
               for rel, attr, v in anchor.links]
    if clauses:
        np += " " + " and ".join(clauses)
    for rel, quals, y in zip(relations, qualifiers, c_path[1:]):
        head = describe(kind_of(y), quals).removeprefix("the ")
        np = _STEP[rel].format(x=np, y=head)
    return f"{_WHICH[kind_of(c_path[-1])]} is {np}?"


class RuleSynthesizer(Synthesizer):
    """Knows the world: extraction is the world's relations inside the subgraph, the path a
    backward walk from the answer, abstraction a greedy set of attribute / relation constraints
    until the description fits one entity."""

    source = "world-rule"

    def __init__(self, world: World, min_hops: int = 3, max_hops: int | None = None,
                 max_entities: int = 48, max_anchor_constraints: int = 4,
                 anchor: str = "abstract", unique_steps: bool = False):
        self.world = world
        self.unique_steps = unique_steps  # only hops whose relation has one object
        self.anchor = anchor  # "named": the first entity keeps its name (an easier task)
        self.min_hops = min_hops
        self.max_hops = max_hops if max_hops is not None else min_hops + 1
        self.max_entities = max_entities
        self.max_anchor_constraints = max_anchor_constraints
        self.verifier = RuleVerifier(world, min_hops)

    def entity_graph(self, seed: Seed) -> tuple[list[int], dict[int, list[tuple[str, int]]]]:
        """At most `max_entities` entities of the subgraph's pages, and the typed relations
        among them."""
        w = self.world
        nodes = [e for e in (w.by_url(u) for u in seed.subgraph) if e is not None]
        nodes = nodes[:self.max_entities]
        inside = set(nodes)
        return nodes, {x: [(r, y) for r, y in w.neighbors(x) if y in inside] for x in nodes}

    def _path(self, answer: int, edges: dict[int, list[tuple[str, int]]],
              rng: random.Random) -> tuple[list[int], list[str]] | None:
        """e0 ... answer, walked backwards from the answer, every node new and joined only to
        its path neighbours (no shortcut)."""
        w = self.world
        hops = rng.randint(self.min_hops, self.max_hops)
        for _ in range(8):
            path, rels = [answer], []
            while len(rels) < hops:
                options = edges.get(path[-1], [])[:]
                rng.shuffle(options)
                step = None
                for rel, x in options:
                    if x in path or x not in edges:
                        continue
                    near = {y for _, y in w.neighbors(x)}
                    if near & set(path[:-1]):
                        continue
                    step = (RELATIONS[rel].inverse, x)
                    break
                if step is None:
                    break
                rels.append(step[0])
                path.append(step[1])
            if len(rels) == hops:
                return path[::-1], rels[::-1]
        return None

    def _qualify(self, x: int, rel: str, y: int) -> tuple[Constraint, ...] | None:
        """The fewest attributes of y that single it out among x's `rel` objects."""
        w = self.world
        siblings = [s for s in w.objects(x, rel) if s != y]
        if not siblings:
            return ()
        items = sorted(w.attrs(y).items())
        options = [(i,) for i in items] + [(a, b) for k, a in enumerate(items)
                                           for b in items[k + 1:]]
        for quals in options:
            if not any(all(w.attrs(s).get(k) == v for k, v in quals) for s in siblings):
                return quals
        return None

    def _anchor(self, e0: int, path: Sequence[int], rng: random.Random) -> Anchor | None:
        """Greedy: add the constraint that leaves fewest candidates until only e0 fits."""
        w = self.world
        kind = w.kind(e0)
        pool: list[tuple[str, ...]] = [("attr", k, v) for k, v in w.attrs(e0).items()]
        for rel, y in w.forward(e0):
            if y not in path and (rel in FORWARD or rel == "capital_of"):
                pool += [("link", rel, k, v) for k, v in w.attrs(y).items()]
        rng.shuffle(pool)  # ties broken at random: varied descriptions
        chosen: list[tuple[str, ...]] = []
        verifier = self.verifier
        fits = set(w.ids(kind))
        while len(fits) > 1 and len(chosen) < self.max_anchor_constraints and pool:
            best, best_fits = None, fits
            for c in pool:
                a = _as_anchor(e0, kind, [c])
                s = fits & verifier.resolve_anchor(a)
                if len(s) < len(best_fits):
                    best, best_fits = c, s
            if best is None:
                break
            chosen.append(best)
            pool.remove(best)
            fits = best_fits
        return _as_anchor(e0, kind, chosen) if fits == {e0} else None

    async def generate(self, seed: Seed, rng: random.Random) -> tuple[Candidate | None, str]:
        w = self.world
        answer = w.by_url(seed.answer_url)
        if answer is None:
            return None, "unknown_answer_page"
        _nodes, edges = self.entity_graph(seed)
        found = self._path(answer, edges, rng)
        if found is None:
            return None, "no_path"
        path, rels = found
        quals = []
        for x, rel, y in zip(path, rels, path[1:]):
            q = self._qualify(x, rel, y)
            if q is None:
                return None, "step_not_unique"
            if q and self.unique_steps:
                return None, "step_needs_qualifier"
            quals.append(q)
        anchor = (Anchor(path[0], w.kind(path[0]), name=w.name(path[0]))
                  if self.anchor == "named" else self._anchor(path[0], path, rng))
        if anchor is None:
            return None, "anchor_not_unique"
        text = render_question(w.kind, path, anchor, rels, quals)
        return Candidate(
            question=text, answer=w.name(answer), answer_aliases=w.aliases(answer),
            path=tuple(path), relations=tuple(rels), qualifiers=tuple(quals), anchor=anchor,
            source=self.source, support=tuple(w.url_of(e) for e in path),
            facts=tuple(w.name(e) for e in path[1:-1])), ""

    async def verify(self, candidate: Candidate) -> Verdict:
        return self.verifier.check(candidate)

    def to_qa(self, c: Candidate) -> QA:
        accepted = [a for a in c.answer_aliases if not (a.isupper() and len(a) <= 4)]
        return QA(c.question, (c.answer, *accepted), c.support[-1], c.hops, c.difficulty,
                  c.source, c.kind, c.support, c.facts, c.support[0], c.anchor.name)


def _as_anchor(e0: int, kind: str, constraints: Sequence[tuple[str, ...]]) -> Anchor:
    attrs = tuple((c[1], c[2]) for c in constraints if c[0] == "attr")
    links = tuple((c[1], c[2], c[3]) for c in constraints if c[0] == "link")
    return Anchor(e0, kind, attrs, links)


# -- LLM-driven, over any pages ---------------------------------------------------------------

@dataclass
class LLMCandidate:
    question: str
    answer: str
    aliases: tuple[str, ...]
    path: tuple[str, ...]
    relations: tuple[str, ...]
    anchors: dict[str, str]
    graph: str               # the entity graph as triples, given to the grounded reference
    names: dict[str, tuple[str, ...]]  # every extracted entity → its aliases
    support: tuple[str, ...]


def _reason(err: str | None) -> str:
    """'unparseable: bad_json: ...' → 'bad_json'; 'http_5xx: ...' → 'http_5xx'."""
    parts = (err or "failed").split(": ")
    return parts[1] if parts[0] == "unparseable" and len(parts) > 1 else parts[0]


def _check_graph(obj: dict[str, Any], max_entities: int) -> dict[str, Any] | Any:
    from megatron_rl.utils.chat_client import ReplyFailure

    for i, e in enumerate(obj["entities"]):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not e["name"].strip():
            return ReplyFailure("bad_field", f"entities[{i}].name: a non-empty string")
        if not isinstance(e.get("aliases", []), list) or \
                not all(isinstance(a, str) for a in e.get("aliases", [])):
            return ReplyFailure("bad_field", f"entities[{i}].aliases: a list of strings")
    if not obj["entities"] or len(obj["entities"]) > max_entities:
        return ReplyFailure("bad_field", f"entities: 1 to {max_entities}, got "
                            f"{len(obj['entities'])}")
    names = {e["name"] for e in obj["entities"]}
    for i, r in enumerate(obj["relations"]):
        if not isinstance(r, dict) or not all(isinstance(r.get(k), str)
                                              for k in ("head", "relation", "tail")):
            return ReplyFailure("bad_field", f"relations[{i}]: {{head, relation, tail}} strings")
        for k in ("head", "tail"):
            if r[k] not in names:
                return ReplyFailure("bad_field", f"relations[{i}].{k}: {r[k]!r} is no entity")
    return obj


class LLMSynthesizer(Synthesizer):
    """Three calls per seed (extract the entity graph, compose a question along a path,
    abstract its anchors), then text rules and the dual-criteria check."""

    def __init__(self, client: ChatClient, verifier: DualCriteriaVerifier | None,
                 min_hops: int = 3, max_entities: int = 32, prompt_dir: Path = PROMPT_DIR):
        self.client = client
        self.verifier = verifier
        self.min_hops = min_hops
        self.max_entities = max_entities
        self.prompt_dir = prompt_dir
        self.source = f"llm:{client.config.model}"

    def _prompt(self, name: str, **values: Any) -> list[dict[str, str]]:
        text = load_prompt(name, self.prompt_dir).format(note=UNTRUSTED_NOTE, **values)
        return [{"role": "user", "content": text}]

    async def generate(self, seed: Seed, rng: random.Random) -> tuple[LLMCandidate | None, str]:
        pages = "\n\n".join(f"Page {i + 1}: {url}\n" + quote_untrusted("page", f"{t}\n{x}")
                            for i, (url, (t, x)) in enumerate(seed.texts.items()))
        answer = seed.texts[seed.answer_url][0]
        graph, err = await self.client.call(
            self._prompt("extract_graph.txt", pages=pages, max_entities=self.max_entities),
            lambda t: _parsed(t, {"entities": list, "relations": list}, "extract",
                              lambda o: _check_graph(o, self.max_entities)))
        if graph is None:
            return None, f"extract:{_reason(err)}"
        names = {e["name"]: tuple(e.get("aliases", [])) for e in graph["entities"]}
        if answer not in names:
            return None, "extract:answer_missing"
        triples = [(r["head"], r["relation"], r["tail"]) for r in graph["relations"]]
        graph_text = "\n".join(f"{h} --{r}--> {t}" for h, r, t in triples)
        composed, err = await self.client.call(
            self._prompt("compose_question.txt", graph=quote_untrusted("graph", graph_text),
                         answer=quote_untrusted("answer", answer), min_hops=self.min_hops),
            lambda t: parse_json_object(t, {"question": str, "path": list, "relations": list},
                                        "compose"))
        if composed is None:
            return None, f"compose:{_reason(err)}"
        path, rels = composed["path"], composed["relations"]
        if not all(isinstance(p, str) for p in path + rels) or len(rels) != len(path) - 1 or \
                not path or path[-1] != answer:
            return None, "compose:bad_path"
        edges = {(h, t) for h, _, t in triples} | {(t, h) for h, _, t in triples}
        if any((a, b) not in edges for a, b in itertools.pairwise(path)):
            return None, "compose:path_not_in_graph"
        abstracted, err = await self.client.call(
            self._prompt("abstract_anchors.txt", question=quote_untrusted(
                "question", composed["question"]), answer=quote_untrusted("answer", answer),
                names=quote_untrusted("names", json.dumps(
                    {n: list(a) for n, a in names.items() if n != answer}))),
            lambda t: parse_json_object(t, {"question": str, "anchors": dict}, "abstract"))
        if abstracted is None:
            return None, f"abstract:{_reason(err)}"
        anchors = {str(k): str(v) for k, v in abstracted["anchors"].items()}
        by_title = {t: u for u, (t, _) in seed.texts.items()}
        support = tuple(by_title[p] for p in path if p in by_title) or (seed.answer_url,)
        return LLMCandidate(abstracted["question"], answer, names[answer], tuple(path),
                            tuple(rels), anchors, graph_text, names, support), ""

    async def verify(self, c: LLMCandidate) -> Verdict:
        if len(c.relations) < self.min_hops:
            return Verdict(False, "min_hops", f"{len(c.relations)} hop(s)")
        if mentions(c.question, (c.answer, *c.aliases)):
            return Verdict(False, "answer_leak", "the question names the answer")
        for name, aliases in c.names.items():
            if name != c.answer and mentions(c.question, (name, *aliases)):
                return Verdict(False, "name_leak", f"the question names {name!r}")
        missing = [p for p in c.path[:-1] if p not in c.anchors]
        if missing:
            return Verdict(False, "anchor_missing", f"no description for {missing}")
        if self.verifier is None:
            return Verdict(True)
        return await self.verifier.check(c.question, c.answer, c.graph)

    def to_qa(self, c: LLMCandidate) -> QA:
        return QA(c.question, (c.answer, *c.aliases), c.support[-1], len(c.relations),
                  len(c.relations) + len(c.anchors), self.source, "/".join(c.relations),
                  c.support, tuple(c.path[1:-1]), c.support[0])


def _parsed(text: str, required: dict[str, type], what: str,
            then: Callable[[dict[str, Any]], Any]) -> Any:
    obj = parse_json_object(text, required, what)
    return obj if not isinstance(obj, dict) else then(obj)


# -- the pipeline -----------------------------------------------------------------------------

@dataclass
class SynthesisResult:
    qas: list[QA]
    counts: Counter[str]
    seconds: float = 0.0


def sample_seeds(graph: PageGraph, n: int, rng: random.Random, depth: int, max_pages: int,
                 text_budget: int, answer_urls: Sequence[str] | None = None) -> Iterable[Seed]:
    """Answer-anchored: an answer page, the pages describing it (itself and up to 2 pages
    linking to it), and the subgraph expanded from those along out-links."""
    urls = list(answer_urls) if answer_urls is not None else rng.sample(
        sorted(graph.pages), min(n, len(graph.pages)))
    for url in urls[:n]:
        describing = (url, *graph.in_links(url)[:2])
        sub = graph.expand(describing, depth, max_pages)
        yield Seed(url, describing, tuple(sub),
                   {u: (graph.pages[u][0], graph.pages[u][1][:text_budget]) for u in sub})


@dataclass(frozen=True)
class Avoid:
    """Pages and answer entities another question set uses (`Avoid.of_parquet`)."""

    pages: frozenset[str]
    answers: frozenset[str]

    def touches(self, qa: QA) -> bool:
        return (qa.answer_key in self.answers or qa.start_url in self.pages
                or not self.pages.isdisjoint(qa.support))

    @classmethod
    def of_parquet(cls, paths: Sequence[str | Path]) -> Avoid:
        """From verl parquet files this module wrote (`extra_info.support/answer_entity`)."""
        import pyarrow.parquet as pq

        pages: set[str] = set()
        answers: set[str] = set()
        for path in paths:
            for i, row in enumerate(pq.read_table(path).to_pylist()):
                info = row.get("extra_info")
                if not isinstance(info, dict) or not isinstance(info.get("support"), list):
                    raise ValueError(f"{path}: row {i}: no extra_info.support (--avoid takes "
                                     "question files written by `data synthesize`)")
                pages.update(str(u) for u in info["support"])
                if info.get("answer_entity") is not None:
                    answers.add(str(info["answer_entity"]))
        return cls(frozenset(pages), frozenset(answers))


async def synthesize(graph: PageGraph, synth: Synthesizer, num_questions: int, *, seed: int = 0,
                     max_seeds: int | None = None, depth: int = 3, max_pages: int = 48,
                     text_budget: int = 1500, answer_urls: Sequence[str] | None = None,
                     avoid: Avoid | None = None,
                     progress: Callable[[str], None] | None = print) -> SynthesisResult:
    """Run the stages until `num_questions` are kept or `max_seeds` (default 4×) are spent.
    Seeds are processed one after the other: the same inputs give the same questions.
    `avoid`: questions touching its pages or answers are dropped (an extra training set that
    must not leak a held-out split)."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    counts: Counter[str] = Counter(pages=len(graph.pages), links=graph.num_links)
    qas: list[QA] = []
    questions: set[str] = set()
    limit = max_seeds if max_seeds is not None else 4 * num_questions
    for s in sample_seeds(graph, limit, rng, depth, max_pages, text_budget, answer_urls):
        if len(qas) >= num_questions:
            break
        counts["seeds"] += 1
        counts["subgraph_pages"] += len(s.subgraph)
        candidate, why = await synth.generate(s, random.Random(rng.getrandbits(64)))
        if candidate is None:
            counts[f"rejected:generate:{why}"] += 1
            continue
        counts["generated"] += 1
        verdict = await synth.verify(candidate)
        if not verdict.ok:
            counts[f"rejected:verify:{verdict.reason}"] += 1
            continue
        qa = synth.to_qa(candidate)
        if avoid is not None and avoid.touches(qa):
            counts["rejected:avoided"] += 1
            continue
        if qa.question in questions:
            counts["rejected:duplicate"] += 1
            continue
        questions.add(qa.question)
        qas.append(qa)
        counts["kept"] = len(qas)
        if progress and counts["seeds"] % 100 == 0:
            progress(format_counts(counts))
    counts["kept"] = len(qas)
    result = SynthesisResult(qas, counts, time.perf_counter() - t0)
    if progress:
        progress(format_counts(counts) + f" ({result.seconds:.1f}s)")
    return result


def format_counts(counts: Counter[str]) -> str:
    head = [f"{k}={counts[k]}" for k in ("pages", "links", "seeds", "generated", "kept")]
    rest = [f"{k}={v}" for k, v in sorted(counts.items()) if k.startswith("rejected")]
    return "synthesis: " + " ".join(head + rest)


# -- verl parquet -----------------------------------------------------------------------------

def check_splits(held_out_fraction: float, shares: Mapping[str, float] | None = None
                 ) -> dict[str, float]:
    """The non-train splits' fractions, held_out first; ValueError names a bad one."""
    wanted = {"held_out": held_out_fraction, **(shares or {})}
    for name, frac in wanted.items():
        if not 0 <= frac < 1:
            raise ValueError(f"{name} fraction={frac}: in [0, 1)")
    if "train" in (shares or {}) or sum(wanted.values()) >= 1:
        raise ValueError(f"splits {wanted}: train takes the rest, so the fractions must sum "
                         "below 1 and none may be named train")
    return wanted


def split_by_answer(qas: Sequence[QA], held_out_fraction: float, seed: int,
                    shares: Mapping[str, float] | None = None) -> dict[str, list[QA]]:
    """`train`, `held_out` and each of `shares` (name -> fraction): every split gets the
    questions of its share of the answer entities, so no answer is in two. Entities are ranked
    by a seeded hash; the held-out split takes the first, the named shares the next in order
    and train the rest, so a held-out split is stable as shares are added or questions grow."""
    wanted = check_splits(held_out_fraction, shares)
    keys = sorted({q.answer_key for q in qas},
                  key=lambda k: zlib.crc32(f"{seed}:{k}".encode()))
    of_key: dict[str, str] = {}
    start = 0
    for name, frac in wanted.items():
        n = round(frac * len(keys))
        if frac > 0:  # a share asked for gets an entity, as long as train keeps one
            n = max(n, 1)
        n = max(0, min(n, len(keys) - 1 - start))
        of_key.update(dict.fromkeys(keys[start:start + n], name))
        start += n
    out: dict[str, list[QA]] = {"train": [], **{name: [] for name in wanted}}
    for q in qas:
        out[of_key.get(q.answer_key, "train")].append(q)
    return out


def verl_rows(qas: Sequence[QA], split: str) -> list[dict[str, Any]]:
    return [{
        "data_source": f"iris/{q.source}",
        "prompt": [{"role": "user", "content": q.question}],
        "ability": "deep_search",
        "reward_model": {"style": "rule", "ground_truth": list(q.answers)},
        "extra_info": {"index": i, "split": split, "hops": q.hops, "difficulty": q.difficulty,
                       "source": q.source, "kind": q.kind, "answer_entity": q.answer_key,
                       "support": list(q.support), "facts": list(q.facts),
                       **({"start": q.start_name} if q.start_name else {})},
    } for i, q in enumerate(qas)]


def write_verl(qas: Sequence[QA], out: str | Path, held_out_fraction: float = 0.1,
               seed: int = 0, shares: Mapping[str, float] | None = None) -> dict[str, Path]:
    """`out/<split>.parquet` for each non-empty split of `split_by_answer`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, part in split_by_answer(qas, held_out_fraction, seed, shares).items():
        if part:
            paths[name] = out / f"{name}.parquet"
            pq.write_table(pa.Table.from_pylist(verl_rows(part, name)), paths[name])
    return paths


# -- CLI --------------------------------------------------------------------------------------

def add_synthesize_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`synthesize`: questions from the generated world (rule-based, no LLM) or, with
    `--synthesizer llm`, from any pages through an OpenAI-compatible endpoint."""
    p = subparsers.add_parser("synthesize", help="Iris web-graph QA synthesis → verl parquet")
    p.add_argument("--pages", type=int, default=2000, help="pages of the generated world")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", help="pages (.parquet/.jsonl with url, title, text[, links]) "
                   "instead of the generated world (llm synthesizer only)")
    p.add_argument("--questions", type=int, default=500, help="questions to keep")
    p.add_argument("--max-seeds", type=int, default=None, help="default: 4 × --questions")
    p.add_argument("--min-hops", type=int, default=3)
    p.add_argument("--max-hops", type=int, default=None, help="default: --min-hops + 1")
    p.add_argument("--unique-steps", action="store_true", help="rule: keep only paths whose "
                   "every hop has one object (no qualifier to check: an easier task)")
    p.add_argument("--anchor", choices=("abstract", "named"), default="abstract",
                   help="rule: abstract the first entity into a description (Iris), or name "
                   "it (the later hops stay searches either way)")
    p.add_argument("--max-pages", type=int, default=48, help="pages per expanded subgraph")
    p.add_argument("--text-budget", type=int, default=1500, help="characters kept per page")
    p.add_argument("--held-out-fraction", type=float, default=0.1)
    p.add_argument("--split", action="append", default=[], metavar="NAME=FRACTION",
                   type=_split_arg, help="one more split by answer entity, written to "
                   "NAME.parquet (e.g. rl=0.2: RL questions whose answers neither SFT nor "
                   "the held-out split has); repeatable; train keeps the rest")
    p.add_argument("--avoid", action="append", default=[], metavar="PARQUET",
                   help="drop questions that touch a support page or an answer entity of "
                   "these questions (e.g. a held-out split an extra training set must not "
                   "leak); repeatable")
    p.add_argument("--out", required=True, help="folder for train.parquet, held_out.parquet, "
                   "counts.json")
    p.add_argument("--synthesizer", choices=("rule", "llm"), default="rule")
    p.add_argument("--base-url", help="llm: OpenAI-compatible /v1 URL of the synthesizer")
    p.add_argument("--model", default="default")
    p.add_argument("--api-key-env", default=None)
    p.add_argument("--reference-base-url", help="llm: the reference model (default: --base-url)")
    p.add_argument("--reference-model", default=None)
    p.add_argument("--judge-base-url", help="llm: the semantic judge (default: reference)")
    p.add_argument("--judge-model", default=None)
    p.set_defaults(func=run_synthesize)
    return p


def _split_arg(text: str) -> tuple[str, float]:
    name, sep, frac = text.partition("=")
    if not sep or not name.isidentifier() or name in ("train", "held_out"):
        raise argparse.ArgumentTypeError(f"{text!r}: NAME=FRACTION with a new split name "
                                         "(train and held_out are taken)")
    try:
        return name, float(frac)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: FRACTION is not a number") from None


def run_synthesize(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _run(a: argparse.Namespace) -> int:
    try:
        check_splits(a.held_out_fraction, dict(a.split))
    except ValueError as e:
        print(f"--held-out-fraction / --split: {e}")
        return 2
    world = None
    if a.corpus:
        if a.synthesizer == "rule":
            print("--corpus: the rule synthesizer needs the generated world (drop --corpus or "
                  "use --synthesizer llm)")
            return 2
        graph = PageGraph.from_corpus(a.corpus)
    else:
        world = generate_world(a.pages, a.seed)
        graph = PageGraph.from_pages(world.pages())
    clients: list[ChatClient] = []
    if a.synthesizer == "rule":
        assert world is not None
        synth: Synthesizer = RuleSynthesizer(world, a.min_hops, a.max_hops, anchor=a.anchor,
                                             unique_steps=a.unique_steps)
    else:
        if not a.base_url:
            print("--synthesizer llm needs --base-url")
            return 2
        key = a.api_key_env
        main = ChatClient(ClientConfig(a.base_url, a.model, key, max_tokens=2048))
        ref = ChatClient(ClientConfig(a.reference_base_url or a.base_url,
                                      a.reference_model or a.model, key))
        judge = ChatClient(ClientConfig(a.judge_base_url or a.reference_base_url or a.base_url,
                                        a.judge_model or a.reference_model or a.model, key))
        clients = [main, ref, judge]
        synth = LLMSynthesizer(main, DualCriteriaVerifier(ref, judge), a.min_hops)
    try:
        result = await synthesize(graph, synth, a.questions, seed=a.seed, max_seeds=a.max_seeds,
                                  max_pages=a.max_pages, text_budget=a.text_budget,
                                  avoid=Avoid.of_parquet(a.avoid) if a.avoid else None)
    finally:
        for c in clients:
            await c.close()
    paths = write_verl(result.qas, a.out, a.held_out_fraction, a.seed, dict(a.split))
    Path(a.out, "counts.json").write_text(json.dumps(dict(result.counts), indent=1,
                                                     sort_keys=True))
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0 if result.qas else 1
