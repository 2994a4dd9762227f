"""A rubric judge without an LLM for questions with a known path (the embedded world): RDPO's
per-turn Planner / Synthesizer scores on a CPU.

A question of the generated world (or a synthesized one) carries its path in the prompt's
metadata, copied onto its trajectories: `support` (the pages of each hop, in order), `facts`
(the bridge entity each hop leads to, the answer excluded), and the reference answer; the
oracle teacher reads the same (`teacher.path_of`). The path's *facts* are the bridges and the
answer; a fact is *established* when its name appears in the summary (case and spacing aside,
on word boundaries). The *next unresolved hop* k is the first hop whose fact is not
established; its target is the entity whose page states that fact (the question's subject for
hop 0, else bridge k-1) and that page (`support[k]`).

Rules map each dimension to 5 / 3 / 1 / N/A as the anchors of `configs/rubrics/world/` say
(several calls in one turn: the mean of their scores), and the turn's score is the rubric's own
weighted mean of (s - 1) / 4 (`Rubric.score`): the same files, validation and formula as the
LLM judge (`rewards/rubric.py`), and the same output, `turn.rewards["rubric"]` in [0, 1].

| role | dimension | rule |
|---|---|---|
| Planner | next_hop | a query names the next hop's entity / the URL is its support page |
| Planner | non_redundancy | no query or URL repeats an earlier one of the episode |
| Planner | answer_timing | answers only once the summary holds the answer |
| Synthesizer | retention | the facts the previous summary held are still there |
| Synthesizer | extraction | the revealed facts, each in the evidence's sentence stating it |
| Synthesizer | concision | non-empty when something is known, within `max_summary_chars` |
| Synthesizer | grounding | every URL the new summary states was in the evidence or old summary |

A trajectory without a known path is left unscored (counted in `metrics()`). Model text is
plain data here: only string matching, never evaluated, and any text (empty, huge, odd
arguments, lone `</think>`) gets a score or N/A, never an exception.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from megatron_rl.records.trajectory import ToolCall, Trajectory
from megatron_rl.rewards.base import after_thinking, references
from megatron_rl.rewards.rubric import (
    RUBRIC_DIR,
    Rubric,
    RubricError,
    RubricResult,
    load_rubrics,
)
from megatron_rl.utils.links import ANGLE_URL, MARKDOWN_URL

log = logging.getLogger("megatron_rl.rewards")

WORLD_RUBRIC_DIR = RUBRIC_DIR / "world"
# the dimensions each role's rules can score; a rubric file may use any subset of them
RULES = {"planner": ("next_hop", "non_redundancy", "answer_timing"),
         "synthesizer": ("retention", "extraction", "concision", "grounding")}
# a link's target, `(URL)` or `<URL>`, else a bare URL
_URL = re.compile(rf"\(({MARKDOWN_URL})\)|<({ANGLE_URL})>|(https?://[^\s<>()\[\]\"']+)")
MAX_TEXT_CHARS = 200_000   # a longer text is matched on its first part only (bounds the work)
MAX_QUERIES = 16           # a call's list of queries: the first ones count
_SPECIAL = re.compile(r"<\|[A-Za-z0-9_]{1,40}\|>")  # <|im_end|>, <|endoftext|>, ...
_WORD = re.compile(r"\w+")
_SENTENCE = re.compile(r"[^\n]+?(?:\.(?=\s)|\n|$)")
_LINK = re.compile(r"\[([^\]\n]*)\]\([^)\n]*\)")
CONTINUED = ("length", "abort")  # a turn cut like this is continued by the next (one message)


# -- the known path ---------------------------------------------------------------------------

@dataclass(frozen=True)
class KnownPath:
    """A question's path: its support pages in hop order, the bridge entity each hop leads to
    (the answer excluded), the accepted answers (the first is the path's) and the subject (the
    title of the first support page)."""

    support: tuple[str, ...]
    bridges: tuple[str, ...]
    answers: tuple[str, ...]
    subject: str = ""

    @property
    def facts(self) -> tuple[str, ...]:
        """What the hops establish, in order: the bridges, then the answer."""
        return (*self.bridges, self.answers[0])

    def target(self, hop: int) -> str:
        """The entity whose page states the fact of `hop`."""
        return self.subject if hop == 0 else self.bridges[hop - 1]


def _strings(value: Any) -> list[str]:
    if not isinstance(value, list | tuple):
        return []
    return [v.strip() for v in value if isinstance(v, str) and v.strip()]


def title_of(url: str) -> str:
    """The page title a world URL encodes (`.../wiki/Zorvex_Dynamics` -> `Zorvex Dynamics`)."""
    tail = url.strip().rstrip("/").rsplit("/", 1)[-1]
    return " ".join(unquote(tail).replace("_", " ").split())


def known_path(metadata: Mapping[str, Any] | None, reference: str | None) -> KnownPath | None:
    """The path a trajectory's metadata carries (`support`, `facts`, at the top or under
    `extra_info`, as `teacher.path_of` reads a prompt's); None without support pages or a
    reference answer."""
    if not isinstance(metadata, Mapping) or not isinstance(reference, str):
        return None
    extra = metadata.get("extra_info")
    meta = {**metadata, **(extra if isinstance(extra, Mapping) else {})}
    support = _strings(meta.get("support"))
    answers = [a.strip() for a in references(reference) if a.strip()]
    if not support or not answers:
        return None
    return KnownPath(tuple(support), tuple(_strings(meta.get("facts"))), tuple(answers),
                     title_of(support[0]))


# -- matching ---------------------------------------------------------------------------------

def _norm(text: str) -> str:
    return " ".join(text[:MAX_TEXT_CHARS].casefold().split())


class _Text:
    """A text to look names up in: case and spacing aside, on word boundaries."""

    def __init__(self, text: str):
        self.text = _norm(text if isinstance(text, str) else "")

    def has(self, name: str, masks: Iterable[str] = ()) -> bool:
        """`name` occurs outside the `masks` (longer names that contain it: "Marmirostfield"
        in "College of Marmirostfield" does not say where the college is)."""
        name, text = _norm(name), self.text
        for m in masks:
            text = text.replace(_norm(m), "\x00")
        return bool(name) and re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text) is not None

    def has_any(self, names: Iterable[str]) -> bool:
        return any(self.has(n) for n in names)


def _facts(path: KnownPath) -> list[tuple[str, tuple[str, ...]]]:
    """Each fact of the path as (name, masks): its other names of the path that contain it.
    The answer fact is one entry per accepted answer, `_holds` takes any of them."""
    names = [path.subject, *path.bridges, *path.answers]
    return [(n, tuple(m for m in names if _norm(m) != _norm(n) and _Text(m).has(n)))
            for n in (*path.bridges, *path.answers)]


def _holds(text: _Text, path: KnownPath) -> list[bool]:
    """Per fact of the path (bridges, then the answer): whether `text` states it."""
    found = [text.has(n, masks) for n, masks in _facts(path)]
    k = len(path.bridges)
    return [*found[:k], any(found[k:])]


def _statements(evidence: str, path: KnownPath) -> list[list[str]]:
    """Per fact of the path, the evidence's sentences stating it: those naming the fact and
    the entity of its hop (the subject, or the bridge before it), link markup dropped,
    normalised. What the oracle's notes copy (`teacher.oracle_notes`)."""
    text = _LINK.sub(r"\1", evidence[:MAX_TEXT_CHARS])
    sentences = [_norm(x).rstrip(".") for x in _SENTENCE.findall(text)
                 if "<http" not in x and not x.strip().startswith("A search for")]
    out = []
    for k, (name, masks) in enumerate(_facts(path)):
        target = path.target(min(k, len(path.bridges)))
        out.append([x for x in sentences if _Text(x).has(name, masks)
                    and _Text(x.replace(_norm(name), "\x00")).has(target)])
    k = len(path.bridges)  # one answer fact, stated by any accepted answer's sentences
    return [*out[:k], [x for xs in out[k:] for x in xs]]


def _url(url: str) -> str:
    return url.strip().rstrip("/")


def _words(text: str) -> list[str]:
    return _WORD.findall(text[:MAX_TEXT_CHARS].casefold())


def _query_key(query: str) -> str:
    return " ".join(_words(query))


def resembles(query: str, question: str) -> bool:
    """The query is (most of) the question pasted: at least two words, 60% of them from it."""
    words = set(_words(query))
    return len(words) >= 2 and len(words & set(_words(question))) >= 0.6 * len(words)


def visible(text: Any) -> str:
    """What a message says outside its thinking, without special tokens."""
    body = after_thinking(text) if isinstance(text, str) else None
    return _SPECIAL.sub("", body or "").strip()


# -- the episode, message by message ----------------------------------------------------------

@dataclass
class _Message:
    role: str
    turns: list[int]
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def _messages(traj: Trajectory) -> list[_Message]:
    """Turns grouped into messages: a turn cut by length (or aborted) and resumed by the next
    turn of the same role is one message with it."""
    out: list[_Message] = []
    for i, turn in enumerate(traj.turns):
        prev = traj.turns[i - 1] if i else None
        if not (out and prev is not None and prev.role == turn.role
                and prev.finish_reason in CONTINUED):
            out.append(_Message(turn.role, []))
        m = out[-1]
        m.turns.append(i)
        m.text += turn.text if isinstance(turn.text, str) else ""
        m.calls += [c for c in turn.tool_calls if isinstance(c, ToolCall)]
    return out


def _call(call: ToolCall) -> tuple[str, list[str]] | None:
    """("visit", [url]) or ("search", [queries]) from a call's arguments; None for neither."""
    args = call.arguments if isinstance(call.arguments, Mapping) else {}
    url, query = args.get("url"), args.get("query")
    if isinstance(url, str) and url.strip():
        return "visit", [url]
    queries = [query] if isinstance(query, str) else _strings(query)[:MAX_QUERIES]
    queries = [q for q in queries if q.strip()]
    return ("search", queries) if queries else None


def _out_of_turns(traj: Trajectory) -> bool:
    """The episode ended unanswered at the turn budget, or where a greedy one would have."""
    return "max_turns" in traj.labels or "repeated_state" in traj.labels


def _observations(calls: Sequence[ToolCall]) -> str:
    return "\n".join(c.observation for c in calls if isinstance(c.observation, str))


def _band(kept: int, total: int) -> float:
    """All -> 5, at least half -> 3, fewer -> 1."""
    return 5.0 if kept == total else 3.0 if 2 * kept >= total else 1.0


class WorldRubricScorer:
    """Scores Planner and Synthesizer turns by rules against the question's known path, with
    the dimensions and weights of its rubric files (default `configs/rubrics/world/*.json`).

    `rubrics`: rubric file paths, or parsed rubrics by role; `max_summary_chars`: the length
    bound of `concision`. A recipe turns it on with `rl.rubric: {kind: rule}`."""

    def __init__(self, rubrics: Sequence[str | Path] | Mapping[str, Rubric] | None = None, *,
                 max_summary_chars: int = 1000):
        if isinstance(rubrics, Mapping):
            self.rubrics = dict(rubrics)
        else:
            files = sorted(WORLD_RUBRIC_DIR.glob("*.json")) if rubrics is None else rubrics
            self.rubrics = load_rubrics(files)
        for role, rubric in self.rubrics.items():
            where = rubric.source or role
            if role not in RULES:
                raise RubricError(f"{where}: role {role!r} has no rules; the rule rubric scores "
                                  f"{', '.join(RULES)}")
            for i, d in enumerate(rubric.dimensions):
                if d.name not in RULES[role]:
                    raise RubricError(f"{where}: dimensions[{i}].name: {d.name!r} has no rule; "
                                      f"the {role}'s are {', '.join(RULES[role])}")
        if not isinstance(max_summary_chars, int) or max_summary_chars < 1:
            raise ValueError(f"max_summary_chars={max_summary_chars!r}: an integer >= 1")
        self.max_summary_chars = max_summary_chars
        self.counts = {"trajectories": 0, "no_path": 0, "turns": 0}

    # the rules: raw 1-5 scores (None = N/A) of every dimension of a role

    def planner(self, path: KnownPath, question: str, summary: str, text: str,
                calls: Sequence[ToolCall], answered: bool, earlier: set[tuple[str, str]],
                ran_out: bool = False) -> tuple[dict[str, float | None], str]:
        """`ran_out`: the episode's last Planner turn, and the turn budget ended it unanswered
        (or a repeated greedy state, which would have)."""
        seen = _Text(summary)
        held = _holds(seen, path)
        hop = next((k for k, h in enumerate(held) if not h), None)
        has_answer = held[-1]
        parsed = [] if answered else [_call(c) for c in calls]
        scores: dict[str, float | None] = {}

        # next_hop: the mean over calls; N/A without calls or once every fact is established
        if not parsed or hop is None:
            scores["next_hop"] = None
        else:
            page = _url(path.support[hop]) if hop < len(path.support) else None
            pages = {_url(u) for u in path.support}
            entities = [path.subject, *path.facts, *path.answers]
            target = path.target(hop)
            per_call = []
            for c in parsed:
                if c is None:
                    per_call.append(1.0)
                elif c[0] == "visit":
                    u = _url(c[1][0])
                    per_call.append(5.0 if u == page else 3.0 if u in pages else 1.0)
                else:
                    best = 1.0
                    for q in c[1]:
                        t = _Text(q)
                        if t.has(target) or (hop == 0 and resembles(q, question)):
                            best = 5.0
                            break
                        if t.has_any(entities) or resembles(q, question):
                            best = 3.0
                    per_call.append(best)
            scores["next_hop"] = sum(per_call) / len(per_call)

        # non_redundancy: over the calls with a query or URL
        keys = [(c[0], _url(c[1][0]) if c[0] == "visit" else
                 "\n".join(_query_key(q) for q in c[1])) for c in parsed if c is not None]
        if keys:
            repeats, mine = 0, set()
            for key in keys:
                repeats += key in earlier or key in mine
                mine.add(key)
            scores["non_redundancy"] = 5.0 if not repeats else \
                1.0 if repeats == len(keys) else 3.0
            earlier |= mine
        else:
            scores["non_redundancy"] = None

        # answer_timing
        if answered:
            scores["answer_timing"] = 5.0 if has_answer else 1.0
        elif not calls or ran_out:
            # neither answers nor acts, or searches on until the turns run out: either way the
            # episode ends unanswered (else searching forever outscores any guess)
            scores["answer_timing"] = 1.0
        elif not seen.text:
            scores["answer_timing"] = None
        else:
            scores["answer_timing"] = 3.0 if has_answer else 5.0
        detail = "every fact established" if hop is None else \
            f"next hop {hop}: {path.target(hop)!r}"
        return scores, detail

    def synthesizer(self, path: KnownPath, previous: str, new: str, evidence: str
                    ) -> tuple[dict[str, float | None], str]:
        before, after, shown = (_holds(_Text(t), path) for t in (previous, new, evidence))
        established = [k for k, h in enumerate(before) if h]
        revealed = [k for k, h in enumerate(shown) if h and not before[k]]
        kept = sum(after[k] for k in established)
        found = sum(after[k] for k in revealed)
        # stated: in the evidence's own sentence, not merely named ("X was founded by Y" does
        # not state "X was born in Y"); a fact no sentence of the evidence states counts named
        stated = 0
        if found:  # only then is there a statement to look for
            notes = _norm(_LINK.sub(r"\1", new))
            said = _statements(evidence, path)
            stated = sum(after[k] and (not said[k] or any(x in notes for x in said[k]))
                         for k in revealed)
        scores: dict[str, float | None] = {
            "retention": _band(kept, len(established)) if established else None,
            "extraction": (5.0 if stated == len(revealed) else 3.0 if found else 1.0)
            if revealed else None,
        }
        size = len(new)
        if not new.strip():
            scores["concision"] = 1.0 if established or revealed else None
        else:
            scores["concision"] = 5.0 if size <= self.max_summary_chars else \
                3.0 if size <= 2 * self.max_summary_chars else 1.0
        # an invented URL is a fact the notes make up (what a weak policy writes most)
        urls = {"".join(m).rstrip(".,;:") for m in _URL.findall(new)}
        grounded = sum(u in evidence or u in previous for u in urls)
        scores["grounding"] = _band(grounded, len(urls)) if urls else None
        detail = (f"kept {kept}/{len(established)}, extracted {found}/{len(revealed)} "
                  f"({stated} stated as the evidence does), "
                  f"{grounded}/{len(urls)} URLs grounded, {size} chars")
        return scores, detail

    # the judge protocol

    def rate(self, traj: Trajectory) -> list[RubricResult | None]:
        """Per turn, the rubric result of its message (None for roles without a rubric, and for
        every turn of a trajectory without a known path). Writes nothing."""
        out: list[RubricResult | None] = [None] * len(traj.turns)
        path = known_path(traj.metadata, traj.reference)
        self.counts["trajectories"] += 1
        if path is None:
            if not self.counts["no_path"]:
                log.warning("rule rubric: trajectory %s carries no path (metadata support/"
                            "facts): its turns are not rubric-scored", traj.uid)
            self.counts["no_path"] += 1
            return out
        question = traj.question if isinstance(traj.question, str) else ""
        kept = traj.metadata.get("summaries")
        kept = kept if isinstance(kept, list) else []
        summary, syntheses = "", 0
        evidence: list[ToolCall] = []
        earlier: set[tuple[str, str]] = set()
        messages = _messages(traj)
        for n, m in enumerate(messages):
            text = visible(m.text)
            dims: dict[str, float | None] | None = None
            if m.role == "planner":
                last = not any(x.role == "planner" for x in messages[n + 1:])
                answered = "<answer>" in text or (last and traj.answer is not None
                                                  and not m.calls)
                if "planner" in self.rubrics:
                    dims, detail = self.planner(path, question, summary, text, m.calls,
                                                answered, earlier, ran_out=last and not answered
                                                and _out_of_turns(traj))
                evidence = m.calls
            elif m.role == "synthesizer":
                if "synthesizer" in self.rubrics:
                    dims, detail = self.synthesizer(path, summary, text,
                                                    _observations(evidence))
                # the summary the agent kept (its own record), else this message's text
                recorded = kept[syntheses] if syntheses < len(kept) else None
                summary = recorded if isinstance(recorded, str) else text
                syntheses += 1
            if dims is None:
                continue
            rubric = self.rubrics[m.role]
            dims = {d.name: dims.get(d.name) for d in rubric.dimensions}
            result = RubricResult(rubric.score(dims), dims, None, detail)
            for i in m.turns:
                out[i] = result
        return out

    async def score_trajectory(self, traj: Trajectory) -> list[RubricResult | None]:
        """As `RubricScorer.score_trajectory`: writes `turn.rewards["rubric"]` on every turn
        of a scored message (unless all its dimensions were N/A)."""
        results = self.rate(traj)
        for turn, res in zip(traj.turns, results, strict=True):
            if res is not None and res.score is not None:
                turn.rewards["rubric"] = res.score
                self.counts["turns"] += 1
        return results

    def metrics(self, prefix: str = "rubric_rule") -> dict[str, float]:
        return {f"{prefix}/{k}": float(v) for k, v in self.counts.items()}

    async def close(self) -> None:
        """Nothing to close (the judge protocol's resources are closed with the run)."""
