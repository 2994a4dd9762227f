"""Verification of synthesized questions: rule checks against the embedded world, and the
dual-criteria check (closed-book fails, graph-grounded succeeds) through an LLM.

Rule checks (`RuleVerifier`, the world knows every relation), each a named rejection reason:

- `min_hops`: the path has at least N relations;
- `answer_leak`: no name or alias of the answer appears in the question;
- `name_leak`: no name or alias of any other entity of the world appears in it (so every
  non-answer entity is known only by its description);
- `anchor_touches_path`: the anchor's description refers to no entity of the path (it would
  name a hop, or the answer, by its attributes);
- `shortcut`: no relation joins two path entities that are not consecutive (the path really
  needs every hop);
- `anchor_ambiguous` / `step_ambiguous` / `wrong_answer`: resolving the description and then
  each relation, from the world alone, yields exactly one entity at every step and ends at the
  answer.

`DualCriteriaVerifier` keeps (q, y) only if a reference model fails closed-book AND answers
correctly given the entity graph; equality is decided by a semantic judge (its own small
prompt, `configs/prompts/judge_equivalence.txt`). Every failed call or bad reply is a counted
rejection, never an exception.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.config.loader import CONFIG_ROOT
from megatron_rl.data.world import RELATIONS, World
from megatron_rl.utils.chat_client import (
    UNTRUSTED_NOTE,
    ChatClient,
    ReplyFailure,
    quote_untrusted,
)

PROMPT_DIR = CONFIG_ROOT / "prompts"
MAX_NAME_WORDS = 6  # longest entity name or alias, in words (n-grams checked for leaks)


# -- the structured question ------------------------------------------------------------------

Constraint = tuple[str, Any]  # (attribute, value), e.g. ("founded", 1432)


@dataclass(frozen=True)
class Anchor:
    """The description standing for the path's first entity: its kind, attribute values and
    relations to entities given only by one attribute each ("born in a city founded in 1432")."""

    entity: int
    kind: str
    attrs: tuple[Constraint, ...] = ()
    links: tuple[tuple[str, str, Any], ...] = ()  # (relation, object attribute, value)
    name: str | None = None  # a named anchor: the question names the first entity outright


@dataclass(frozen=True)
class Candidate:
    """A synthesized question with everything needed to verify it: the entity path
    e0 -r1-> e1 ... -rk-> answer, the qualifiers that make each one-to-many hop unique, and
    the anchor abstracting e0. `support` are the path's page URLs, `facts` the bridge names."""

    question: str
    answer: str
    answer_aliases: tuple[str, ...]
    path: tuple[int, ...]
    relations: tuple[str, ...]
    qualifiers: tuple[tuple[Constraint, ...], ...]
    anchor: Anchor
    source: str
    support: tuple[str, ...] = ()
    facts: tuple[str, ...] = ()

    @property
    def hops(self) -> int:
        return len(self.relations)

    @property
    def difficulty(self) -> int:
        """Hops plus the constraints a solver must intersect (anchor and qualifiers)."""
        return (self.hops + len(self.anchor.attrs) + len(self.anchor.links)
                + sum(len(q) for q in self.qualifiers))

    @property
    def kind(self) -> str:
        return "/".join(self.relations)


@dataclass
class Verdict:
    ok: bool
    reason: str = ""
    detail: str = ""


# -- text checks ------------------------------------------------------------------------------

def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def ngrams(text: str, n_max: int = MAX_NAME_WORDS) -> set[str]:
    words = normalize(text).split()
    return {" ".join(words[i:i + n]) for n in range(1, n_max + 1)
            for i in range(len(words) - n + 1)}


def mentions(text: str, names: Iterable[str]) -> list[str]:
    """The names that occur in `text` as whole words, case- and punctuation-insensitive."""
    grams = ngrams(text)
    return [n for n in names if normalize(n) and normalize(n) in grams]


# -- rule checks over the world ---------------------------------------------------------------

class RuleVerifier:
    """Checks a `Candidate` against the world's own relations (see the module docstring)."""

    CHECKS = ("min_hops", "answer_leak", "name_leak", "anchor_touches_path", "shortcut",
              "anchor_ambiguous", "step_ambiguous", "wrong_answer")  # in the order applied

    def __init__(self, world: World, min_hops: int = 3):
        self.world = world
        self.min_hops = min_hops
        self._names: dict[str, int] | None = None
        self._holders: dict[str, dict[str, set[int]]] = {}  # kind -> exact name -> entities

    def _name_index(self) -> dict[str, int]:
        """Every normalized name and alias of the world → one entity holding it (built once)."""
        if self._names is None:
            names: dict[str, int] = {}
            for eid in range(len(self.world)):
                for n in self.world.names(eid):
                    names.setdefault(normalize(n), eid)
            self._names = names
        return self._names

    def _named(self, kind: str, name: str) -> set[int]:
        """The entities of `kind` whose name or an alias is exactly `name` (an index per kind,
        built once: scanning every entity per anchor was 60 % of a synthesis run)."""
        if kind not in self._holders:
            holders: dict[str, set[int]] = {}
            for e in self.world.ids(kind):
                for n in self.world.names(e):
                    holders.setdefault(n, set()).add(e)
            self._holders[kind] = holders
        return set(self._holders[kind].get(name, ()))

    def resolve_anchor(self, anchor: Anchor) -> set[int]:
        w = self.world
        if anchor.name is not None:
            return self._named(anchor.kind, anchor.name)
        out: set[int] | None = None
        for attr, value in anchor.attrs:
            s = set(w.with_attr(anchor.kind, attr, value))
            out = s if out is None else out & s
        for rel, attr, value in anchor.links:
            r = RELATIONS[rel]
            s = {x for y in w.with_attr(r.dst, attr, value) for x in w.objects(y, r.inverse)
                 if w.kind(x) == anchor.kind}
            out = s if out is None else out & s
        return set(w.ids(anchor.kind)) if out is None else out

    def walk(self, anchor: Anchor, relations: Sequence[str],
             qualifiers: Sequence[Sequence[Constraint]]) -> list[set[int]]:
        """The entity sets the description reaches, hop by hop (the first is the anchor's)."""
        w = self.world
        sets = [self.resolve_anchor(anchor)]
        for rel, quals in zip(relations, qualifiers):
            nxt = set()
            for x in sets[-1]:
                for y in w.objects(x, rel):
                    a = w.attrs(y)
                    if all(a.get(k) == v for k, v in quals):
                        nxt.add(y)
            sets.append(nxt)
        return sets

    def check(self, c: Candidate) -> Verdict:
        w = self.world
        if c.hops < self.min_hops:
            return Verdict(False, "min_hops", f"{c.hops} hop(s), need {self.min_hops}")
        answer_id = c.path[-1]
        leaked = mentions(c.question, w.names(answer_id))
        if leaked:
            return Verdict(False, "answer_leak", f"the question names the answer as {leaked}")
        names = self._name_index()
        named = c.path[0] if c.anchor.name is not None else None
        for gram in ngrams(c.question):
            eid = names.get(gram)
            if eid is not None and eid not in (answer_id, named):
                return Verdict(False, "name_leak", f"{gram!r} names {w.name(eid)!r}")
        path = set(c.path)
        for rel, _attr, _value in c.anchor.links:
            touched = set(w.objects(c.path[0], rel)) & path
            if touched:
                return Verdict(False, "anchor_touches_path",
                               f"the anchor's {rel} is {w.name(touched.pop())!r}, on the path")
        for i, x in enumerate(c.path):
            near = {y for _, y in w.neighbors(x)}
            for j in range(i + 2, len(c.path)):
                if c.path[j] in near:
                    return Verdict(False, "shortcut", f"{w.name(x)!r} is joined to "
                                   f"{w.name(c.path[j])!r} directly (hops {i} → {j})")
        sets = self.walk(c.anchor, c.relations, c.qualifiers)
        if sets[0] != {c.path[0]}:
            return Verdict(False, "anchor_ambiguous",
                           f"the description fits {len(sets[0])} {c.anchor.kind} entities")
        for i, s in enumerate(sets[1:-1], 1):
            if len(s) != 1:
                return Verdict(False, "step_ambiguous",
                               f"hop {i} ({c.relations[i - 1]}) reaches {len(s)} entities")
        if sets[-1] != {answer_id}:
            return Verdict(False, "step_ambiguous" if len(sets[-1]) > 1 else "wrong_answer",
                           f"the last hop reaches {sorted(w.name(e) for e in sets[-1])[:5]}")
        return Verdict(True)


# -- dual criteria through an LLM -------------------------------------------------------------

def load_prompt(name: str, folder: Path = PROMPT_DIR) -> str:
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such prompt file")
    return path.read_text(encoding="utf-8")


def parse_json_object(text: str, required: dict[str, type | tuple[type, ...]],
                      what: str) -> dict[str, Any] | ReplyFailure:
    """The first JSON object in a reply (a ```json fence is allowed), with `required` fields of
    the given types; anything else is a `ReplyFailure` naming the field."""
    s = text.strip()
    fence = re.search(r"```(?:json)?\s*(.*?)```", s, re.S)
    if fence:
        s = fence.group(1).strip()
    start = s.find("{")
    if start < 0:
        return ReplyFailure("bad_json", f"{what}: no JSON object in the reply")
    try:
        obj, _ = json.JSONDecoder().raw_decode(s[start:])
    except (json.JSONDecodeError, RecursionError) as e:
        return ReplyFailure("bad_json", f"{what}: not JSON ({e})")
    if not isinstance(obj, dict):
        return ReplyFailure("bad_json", f"{what}: a JSON object, got {type(obj).__name__}")
    for key, typ in required.items():
        if key not in obj:
            return ReplyFailure("missing_field", f"{what}: missing field {key!r}")
        if not isinstance(obj[key], typ) or (isinstance(obj[key], bool) and typ is not bool):
            return ReplyFailure("bad_field", f"{what}.{key}: expected "
                                f"{getattr(typ, '__name__', typ)}, got {type(obj[key]).__name__}")
    return obj


@dataclass
class DualCriteriaVerifier:
    """Keep a question only if the reference model fails it closed-book and solves it given
    the entity graph; both answers are compared with the gold one by a semantic judge."""

    reference: ChatClient
    judge: ChatClient
    prompt_dir: Path = PROMPT_DIR
    stats: Counter[str] = field(default_factory=Counter)

    async def _answer(self, template: str, question: str, graph: str) -> str | None:
        prompt = load_prompt(template, self.prompt_dir).format(
            note=UNTRUSTED_NOTE, question=quote_untrusted("question", question),
            graph=quote_untrusted("graph", graph))
        value, _err = await self.reference.call(
            [{"role": "user", "content": prompt}],
            lambda t: parse_json_object(t, {"answer": str}, "reference reply"))
        return None if value is None else value["answer"]

    async def _same(self, question: str, gold: str, predicted: str) -> bool | None:
        prompt = load_prompt("judge_equivalence.txt", self.prompt_dir).format(
            note=UNTRUSTED_NOTE, question=quote_untrusted("question", question),
            gold=quote_untrusted("gold", gold), predicted=quote_untrusted("predicted", predicted))
        value, _err = await self.judge.call(
            [{"role": "user", "content": prompt}],
            lambda t: parse_json_object(t, {"equivalent": bool}, "judge reply"))
        return None if value is None else value["equivalent"]

    async def check(self, question: str, answer: str, graph: str) -> Verdict:
        closed = await self._answer("reference_closed_book.txt", question, "")
        if closed is None:
            return Verdict(False, "reference_error", "closed-book call failed")
        same = await self._same(question, answer, closed)
        if same is None:
            return Verdict(False, "judge_error", "judge call failed (closed-book)")
        if same:
            return Verdict(False, "closed_book_solved", f"answered {closed!r} without search")
        grounded = await self._answer("reference_with_graph.txt", question, graph)
        if grounded is None:
            return Verdict(False, "reference_error", "graph-grounded call failed")
        same = await self._same(question, answer, grounded)
        if same is None:
            return Verdict(False, "judge_error", "judge call failed (with graph)")
        if not same:
            return Verdict(False, "graph_unsolved", f"answered {grounded!r} given the graph")
        return Verdict(True)
