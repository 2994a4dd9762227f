"""Teacher trajectories (`megatron-rl data teacher`): the run's real agent (ReAct or IterSynth)
with the real search and visit tools, driven by a teacher instead of the policy, written as the
same trajectory JSONL the RL loop dumps (the input of filters and SFT).

- The oracle teacher (the embedded world, or any question that carries its path): an engine
  whose every message follows the known path. ReAct: search the question's named first
  entity (or the question), visit the first support page, then per hop search the bridge
  entity the visited page named and visit its page, then answer. IterSynth: each Planner step
  is a function of what the Planner sees, the question and the notes (`oracle_plan_step`:
  answer once a fact names the answer, else search the deepest entity the facts name, or
  visit the next hop's page when the results did not state its fact), so that a policy can
  learn it; the Synthesizer keeps the current notes and adds a line per new fact (the
  evidence's sentence linking the hop's subject to its bridge entity or answer) or, if none, the
  support pages found among the results (`[title](URL)`; `(read)` once visited). `--visits
  every-page` visits every support page found. The queries and observations are real
  (real index, real pages); a trajectory records in `metadata["teacher"]["grounded"]` whether
  every visited URL had appeared in an earlier observation (a demonstration a policy could
  follow).
- Any OpenAI-compatible teacher (`--teacher-url`): the same agent over that chat model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.agents.base import AgentConfig
from megatron_rl.agents.itersynth import QUESTION_LAST
from megatron_rl.agents.registry import AGENTS
from megatron_rl.config.schema import SearchConfig
from megatron_rl.engines.base import (
    GenerateRequest,
    GenerateResult,
    NoServerControl,
    SamplingParams,
)
from megatron_rl.records.prompt import Prompt
from megatron_rl.records.trajectory import Trajectory
from megatron_rl.rewards.base import references
from megatron_rl.rewards.composite import build_judge, judge_trajectory
from megatron_rl.utils.links import MARKDOWN_URL

_SENTENCE = re.compile(r"[^\n]+?(?:\.(?=\s)|\n|$)")
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
MAX_NOTE_LINES = 8  # a note is a digest: it must fit one response
# when the IterSynth oracle visits: only a page whose fact the search results did not show
# (fewer steps and shorter notes, each one a copy), or every support page it finds
VISITS = ("when-needed", "every-page")


@dataclass
class OraclePath:
    """What the oracle knows of a question: its support pages in hop order, the bridge entity
    each hop leads to (the answer excluded) and the answer."""

    support: list[str]
    bridges: list[str]
    answer: str
    goals: list[str] = field(default_factory=list)
    start: str | None = None  # the first entity's name when the question gives it

    def goal(self, k: int) -> str:
        """The goal of the visit of support page k."""
        return self.goals[k] if k < len(self.goals) else "find the next fact the question needs"


def oracle_messages(question: str, path: OraclePath, family: Any, agent: str) -> list[str]:
    """The teacher's messages in episode order (IterSynth's Synthesizer turns are written
    from the evidence at run time, so only the Planner's are here)."""
    # a named first entity is searched by its name (its page is then among the results: a
    # grounded demonstration); an abstracted one by the question itself
    calls = [("search", {"query": path.start or question})]
    for k, url in enumerate(path.support):
        calls.append(("visit", {"url": url, "goal": path.goal(k)}))
        if k < len(path.bridges) and k + 1 < len(path.support):
            calls.append(("search", {"query": path.bridges[k]}))
    # bare calls and a bare answer: every token a policy must learn is one it can copy
    out = [family.tool_call(name, args) for name, args in calls]
    out.append(f"<answer>{path.answer}</answer>")
    return out


_RESULT = re.compile(rf"\[([^\]\n]+)\]\(({MARKDOWN_URL})\)")
_RESULT_LINE = re.compile(r"^\s*\d+\. \[[^\]\n]*\]\([^)\n]*\)\s*$", re.M)  # a result's title
_VISITED = re.compile(r"^\[\d+\] visit (\{.*\})$", re.M)
# a page to read, written as the results list it (a copy the policy can make token by token)
_PAGE_LINE = re.compile(rf"^- \[(.+?)\]\(({MARKDOWN_URL})\)( \(read\))?$")
READ = " (read)"  # a page line's mark once the page was visited
NOTHING_YET = "- nothing yet"


def _note_lines(notes: str) -> list[str]:
    return [x for x in notes.splitlines() if x.startswith("- ") and x != NOTHING_YET]


def _visited(evidence: str) -> set[str]:
    urls = set()
    for args in _VISITED.findall(evidence):
        try:
            url = json.loads(args).get("url")
        except (ValueError, AttributeError):
            continue
        if isinstance(url, str):
            urls.add(url)
    return urls


def oracle_notes(current: str, evidence: str, path: OraclePath,
                 visits: str = "when-needed") -> str:
    """The oracle Synthesizer's notes: the current ones kept, plus one line per new fact the
    path needs - the sentence of the evidence that links the hop's subject to a bridge entity
    or the answer (what the Planner searches next, or answers). When the evidence named
    nothing new (or `visits="every-page"`): one line per search result that is a support page
    (`- [Title](URL)` as the results list it, what the Planner visits next; marked `(read)`
    once visited); with `visits="when-needed"` these lines go once a new fact is noted."""
    lines = _note_lines(current)
    visited = _visited(evidence)
    lines = [x + READ if (m := _PAGE_LINE.match(x)) and m[2] in visited and not m[3] else x
             for x in lines]
    facts = []
    text = _LINK.sub(r"\1", _RESULT_LINE.sub("", evidence))  # a bare title states no fact
    sentences = [x.strip() for x in _SENTENCE.findall(text)]
    sentences = [x for x in sentences if not x.startswith(("See also", "A search for"))
                 and "<http" not in x and "](" not in x]
    names = (*path.bridges, path.answer)
    for k, name in enumerate(names):
        if any(name in x for x in lines + facts if not _PAGE_LINE.match(x)):
            continue
        # the sentence that links the hop's subject to it states the fact; else any naming it
        subject = names[k - 1] if k else path.start
        found = [x for x in sentences if name in x]
        best = [x for x in found if subject and subject in x.replace(name, "")] or found
        if best:
            facts.append(f"- {best[0]}")
    if visits == "when-needed" and facts:  # the pages have served: their facts are noted
        lines = [x for x in lines if not _PAGE_LINE.match(x)]
    elif visits == "every-page" or not facts:
        noted = {m[2] for x in lines if (m := _PAGE_LINE.match(x))}
        support = set(path.support)
        for title, url in _RESULT.findall(evidence):
            if url in support and url not in noted:
                lines.append(f"- [{title}]({url})")
                noted.add(url)
    return "\n".join((lines + facts)[-MAX_NOTE_LINES:]) or NOTHING_YET


def oracle_plan_step(question: str, notes: str, path: OraclePath, family: Any,
                     visits: str = "when-needed") -> str:
    """The oracle Planner's next message, a function of what it sees (question and notes)
    alone, so that a policy can learn it: answer once a fact names the answer. Else, with
    `visits="when-needed"`: search the deepest bridge a fact names (the start when none does),
    unless the notes list the page of the hop after it, unread (its fact was not in the search
    results): visit that. `visits="every-page"`: visit the first support page noted but not
    read, else search the first bridge a fact names whose page is not noted yet."""
    lines = _note_lines(notes)
    pages = [m for x in lines if (m := _PAGE_LINE.match(x))]
    facts = [x for x in lines if not _PAGE_LINE.match(x)]
    if any(path.answer in x for x in facts):
        return f"<answer>{path.answer}</answer>"

    def visit(url: str) -> str:
        return family.tool_call("visit", {"url": url, "goal": path.goal(path.support.index(url))})

    if visits == "when-needed":
        named = [k for k, b in enumerate(path.bridges) if any(b in x for x in facts)]
        deepest = max(named, default=-1)
        page = path.support[deepest + 1] if deepest + 1 < len(path.support) else None
        if any(m[2] == page and not m[3] for m in pages):
            return visit(page)
        query = path.bridges[deepest] if deepest >= 0 else path.start or question
        return family.tool_call("search", {"query": query})
    for m in pages:
        if not m[3] and m[2] in path.support:
            return visit(m[2])
    noted = {m[2] for m in pages}
    for k, bridge in enumerate(path.bridges):
        if (k + 1 < len(path.support) and path.support[k + 1] not in noted
                and any(bridge in x for x in facts)):
            return family.tool_call("search", {"query": bridge})
    return family.tool_call("search", {"query": path.start or question})


class OracleEngine(NoServerControl):
    """A `RolloutEngine` that writes the oracle's messages: message k of episode `uid` (the
    request id is `uid/k`, as agents number them) is the k-th planned step (ReAct); IterSynth's
    Planner turns come from the notes in their context and its Synthesizer turns are notes
    drawn from the evidence in theirs."""

    weight_version = 0

    def __init__(self, tokenizer: Any, agent: str, visits: str = "when-needed"):
        if visits not in VISITS:
            raise ValueError(f"visits: {visits!r} is not one of {VISITS}")
        self.tokenizer, self.agent, self.visits = tokenizer, agent, visits
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.plans: dict[str, list[str]] = {}
        self.paths: dict[str, OraclePath] = {}
        self.planner_steps: dict[str, int] = {}
        self.questions: dict[str, str] = {}
        self.families: dict[str, Any] = {}

    def plan(self, uid: str, messages: list[str] | None, path: OraclePath, *,
             question: str = "", family: Any = None) -> None:
        """`messages`: the episode's messages in order; None (IterSynth): each Planner message
        is `oracle_plan_step` of the notes the Planner sees."""
        self.plans[uid], self.paths[uid] = messages or [], path
        self.questions[uid], self.families[uid] = question, family

    def _text(self, uid: str, k: int, context: str) -> str:
        plan = self.plans[uid]
        if self.agent != "itersynth":
            return plan[min(k, len(plan) - 1)]
        last_user = context.rsplit("<|im_start|>user", 1)[-1]
        if "New evidence:" not in last_user:  # a Planner turn
            if plan:  # an explicit plan (a test's): its next message
                step = self.planner_steps.get(uid, 0)
                self.planner_steps[uid] = step + 1
                return plan[min(step, len(plan) - 1)]
            notes = last_user.rpartition("Notes so far:")[2].rsplit("<|im_end|>", 1)[0]
            return oracle_plan_step(self.questions[uid], notes, self.paths[uid],
                                    self.families[uid], self.visits)
        head, _, evidence = last_user.rpartition("New evidence:")
        evidence = evidence.rpartition(f"\n\n{QUESTION_LAST}")[0]
        current = head.rpartition("Current notes:")[2]
        return oracle_notes(current, evidence, self.paths[uid], self.visits)

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        uid, _, k = req.rid.rpartition("/")
        context = self.tokenizer.decode(req.input_ids, skip_special_tokens=False)
        ids = [*self.tokenizer.encode(self._text(uid, int(k), context),
                                      add_special_tokens=False), self.end_id]
        finish = "stop"
        if len(ids) > req.sampling.max_new_tokens:
            ids, finish = ids[:req.sampling.max_new_tokens], "length"
        return GenerateResult(req.rid, ids, [0.0] * len(ids), finish, [0] * len(ids),
                              prompt_tokens=len(req.input_ids))

    async def update_weights_from_tensors(self, named_tensors: Any, weight_version: int) -> None:
        raise NotImplementedError("the oracle teacher takes no weights")

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        raise NotImplementedError("the oracle teacher takes no weights")


def grounded(traj: Trajectory) -> bool:
    """Every visited URL appeared in an observation before the visit."""
    seen: list[str] = []
    for turn in traj.turns:
        for call in turn.tool_calls:
            url = str(call.arguments.get("url"))
            if call.name == "visit" and not any(url in o for o in seen):
                return False
            seen.append(call.observation or "")
    return True


def path_of(prompt: Prompt) -> OraclePath | None:
    """A prompt's path from its metadata (`support`, `facts`), as world questions and
    synthesized rows carry it; None when it has none."""
    meta = {**prompt.metadata, **prompt.metadata.get("extra_info", {})}
    support = meta.get("support") or []
    if not support:
        return None
    start = meta.get("start")
    return OraclePath(list(support), list(meta.get("facts") or []),
                      references(prompt.answer)[0],  # the first of a JSON list of answers
                      start=start if isinstance(start, str) and start else None)


async def run_teacher(prompts: Sequence[Prompt], agent: Any, engine: Any, *, oracle: bool,
                      judge: Any, out: Path, concurrency: int = 8,
                      progress: bool = True) -> dict[str, int]:
    """Run `agent` on every prompt with `engine` (an `OracleEngine` when `oracle`), judge the
    answers, append the trajectories to `out` (JSONL, `step` 0). Returns counts."""
    from tqdm import tqdm

    counts = {"prompts": len(prompts), "written": 0, "correct": 0, "grounded": 0,
              "no_path": 0}
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(prompts), desc="teacher", disable=not progress)
    out.parent.mkdir(parents=True, exist_ok=True)

    async def one(p: Prompt) -> Trajectory | None:
        async with sem:
            if oracle:
                path = path_of(p)
                if path is None:
                    counts["no_path"] += 1
                    return None
                family = agent.chat.family
                engine.plan(p.uid, None if engine.agent == "itersynth" else
                            oracle_messages(p.question, path, family, engine.agent), path,
                            question=p.question, family=family)
            traj = await agent.run(p.question, p.answer, engine, group_id=p.uid, uid=p.uid,
                                   **({"messages": p.messages} if p.messages else {}))
            traj.metadata.update(p.metadata)
            await judge_trajectory(traj, judge)
            traj.metadata["teacher"] = {"kind": "oracle" if oracle else "model",
                                        "grounded": grounded(traj)}
            bar.update(1)
            return traj

    with out.open("a") as f:
        for traj in await asyncio.gather(*(one(p) for p in prompts)):
            if traj is None:
                continue
            counts["written"] += 1
            counts["correct"] += traj.rewards.get("outcome", 0.0) >= 1.0
            counts["grounded"] += traj.metadata["teacher"]["grounded"]
            row = traj.to_dict()
            for turn in row["turns"]:
                turn.pop("routed_experts", None)
            f.write(json.dumps({"step": 0, **row}, allow_nan=False) + "\n")
    bar.close()
    return counts


def world_prompts(pages: int, seed: int, n: int) -> tuple[list[Prompt], Any]:
    from megatron_rl.data.world import generate_world

    world = generate_world(num_docs=pages, seed=seed)
    qs = list({q.question: q for q in world.questions(n, seed=seed)}.values())
    return [Prompt(q.question, q.answer, f"w{i}", metadata={
        "support": list(q.support), "facts": list(q.facts), "kind": q.kind})
        for i, q in enumerate(qs)], world


def main(args: argparse.Namespace) -> int:
    from megatron_rl.agents.tokenizer import run_tokenizer
    from megatron_rl.data.parquet import read_prompts
    from megatron_rl.data.world import build_world_index
    from megatron_rl.env.search import LocalSearch
    from megatron_rl.env.visit import LocalPages, Visit

    t0 = time.time()
    # a tokenizer folder is taken at its own size unless --vocab-size bounds it
    vocab = args.vocab_size or (sys.maxsize if args.tokenizer else 512)
    tokenizer = run_tokenizer(args.tokenizer, "tiny-moe", vocab_size=vocab)
    out = Path(args.out)
    if args.questions:
        prompts = read_prompts([args.questions])
        if not args.index:
            raise ValueError("--index: a search index is needed with --questions")
        index = Path(args.index)
    else:
        prompts, world = world_prompts(args.pages, args.seed, args.num_questions)
        index = Path(args.index) if args.index else \
            build_world_index(world, out.parent / f"world-{args.pages}-{args.seed}")
    tools = [LocalSearch(index, top_k=args.top_k), Visit(LocalPages(index))]
    cfg = AgentConfig(max_turns=args.max_turns, max_context_tokens=args.max_context_tokens,
                      sampling=SamplingParams(temperature=0.0,
                                              max_new_tokens=args.max_new_tokens),
                      tool_specs=args.tool_specs)
    agent = AGENTS.get(args.agent, "--agent")(tokenizer, tools, cfg)
    if args.teacher_url:
        from megatron_rl.engines.openai_chat import OpenAIChatEngine
        from megatron_rl.utils.chat_client import ChatClient, ClientConfig

        engine: Any = OpenAIChatEngine(ChatClient(ClientConfig(
            base_url=args.teacher_url, model=args.teacher_model,
            api_key_env=args.api_key_env)), tokenizer)
    else:
        engine = OracleEngine(tokenizer, args.agent, args.visits)
    judge = build_judge(None)
    counts = asyncio.run(run_teacher(prompts[:args.limit] if args.limit else prompts, agent,
                                     engine, oracle=not args.teacher_url, judge=judge,
                                     out=out, concurrency=args.concurrency))
    print(f"[teacher] {args.agent}: {counts['written']} trajectories of {counts['prompts']} "
          f"prompts ({counts['correct']} correct, {counts['grounded']} grounded, "
          f"{counts['no_path']} without a path) -> {out} in {time.time() - t0:.1f}s")
    return 0


def add_teacher_parser(sub: Any) -> None:
    t = sub.add_parser("teacher", help="teacher trajectories: the oracle over the embedded "
                       "world (or questions with their path), or any OpenAI-compatible teacher")
    t.add_argument("--out", required=True, help="trajectory JSONL to append to")
    t.add_argument("--agent", default="react", help="react or itersynth")
    t.add_argument("--questions", help="verl parquet/JSONL (default: the world's questions)")
    t.add_argument("--index", help="search index folder (default: the generated world's)")
    t.add_argument("--pages", type=int, default=300)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--num-questions", dest="num_questions", type=int, default=64)
    t.add_argument("--limit", type=int, default=0)
    t.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: built-in)")
    t.add_argument("--vocab-size", dest="vocab_size", type=int, default=0,
                   help="the policy's vocabulary, that the tokenizer must fit (0: a --tokenizer "
                   "folder at its own size, the built-in one at 512)")
    t.add_argument("--teacher-url", dest="teacher_url", default=None)
    t.add_argument("--teacher-model", dest="teacher_model", default="default")
    t.add_argument("--api-key-env", dest="api_key_env", default=None)
    t.add_argument("--max-turns", dest="max_turns", type=int, default=12)
    t.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=512)
    t.add_argument("--no-tool-specs", dest="tool_specs", action="store_false",
                   help="leave the tools' schemas out of the system prompt (~600 tokens): for "
                        "a small policy; train, RL (rl.tool_specs=false) and eval the same way")
    t.add_argument("--top-k", dest="top_k", type=int, default=SearchConfig.top_k,
                   help="search results per call (train, RL and eval the same way: "
                        "env.search.top_k, eval --top-k)")
    t.add_argument("--visits", choices=VISITS, default="when-needed",
                   help="the IterSynth oracle visits a support page only when the search "
                        "results did not show its fact, or every one it finds")
    t.add_argument("--max-context-tokens", dest="max_context_tokens", type=int, default=32768)
    t.add_argument("--concurrency", type=int, default=8)
    t.set_defaults(func=main)
