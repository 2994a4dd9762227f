"""What `megatron-rl train` trains on: a `Task` (prompts, the agent, how a finished group is
scored) and the rollout engine.

- `search` (the embedded default): the agent (ReAct or IterSynth) with local search and visit
  tools over the generated world; the outcome judge (`rl.judge`, rule by default) and, when
  `rl.rubric` names an OpenAI-compatible judge, IterSynth's per-turn rubric scores (RDPO).
- `pick_tokens`: one message per prompt, rewarded with the share of its tokens that have an
  even id. Any policy, even a random one, earns a reward with variance from the first step, so
  a run shows within a few steps whether the loop learns (engine sampling → reward → update →
  sync → better samples), before a real task is worth its time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.agents.base import AgentConfig, BaseAgent, Commit, Resume
from megatron_rl.config.schema import Config
from megatron_rl.rollout.engines.base import GenerateRequest, RolloutEngine, SamplingParams
from megatron_rl.rollout.scheduler import Prompt
from megatron_rl.rollout.trajectory import Trajectory, Turn

TRAIN_QUESTIONS = 64
Score = Callable[[list[Trajectory]], Awaitable[Any]]


@dataclass
class Task:
    prompts: Iterator[Prompt]  # cycled in a fixed order: the checkpoint's data cursor counts them
    held_out: list[Prompt]     # never in `prompts`
    agent: Any                 # samples at rl.temperature
    eval_agent: Any            # greedy
    score: Score               # writes the rewards of a finished group


def build_task(cfg: Config, tokenizer: Any, folder: Path,
               aux_urls: dict[str, list[str]] | None = None) -> Task:
    return {"search": search_task, "pick_tokens": pick_tokens_task}[cfg.rl.task](
        cfg, tokenizer, folder, aux_urls or {})


def _agent_config(cfg: Config, greedy: bool) -> AgentConfig:
    rl = cfg.rl
    return AgentConfig(max_turns=rl.max_turns, max_context_tokens=cfg.model.seq_length,
                       sampling=SamplingParams(temperature=0.0 if greedy else rl.temperature,
                                               max_new_tokens=rl.max_new_tokens),
                       seed=cfg.train.seed, return_routed_experts=rl.routing_replay)


def _cycle(items: list[Any], make: Callable[[Any, str], Prompt]) -> Iterator[Prompt]:
    for epoch in range(1 << 30):
        for i, item in enumerate(items):
            yield make(item, f"q{i}.e{epoch}")


# -- search ------------------------------------------------------------------------------------

def search_task(cfg: Config, tokenizer: Any, folder: Path,
                aux_urls: dict[str, list[str]]) -> Task:
    from megatron_rl.agents import IterSynthAgent, ReActAgent
    from megatron_rl.data.world import build_world_index, generate_world
    from megatron_rl.env.search import LocalSearch
    from megatron_rl.env.visit import LocalPages, Visit
    from megatron_rl.rewards.client import ClientConfig
    from megatron_rl.rewards.composite import build_judge, score_group
    from megatron_rl.rewards.rubric import RubricScorer

    rl = cfg.rl
    world = generate_world(num_docs=rl.world_docs, seed=cfg.train.seed)
    where = folder / f"world-{rl.world_docs}-{cfg.train.seed}"  # deterministic: reusable
    index = where / "index" if (where / "index").is_dir() else build_world_index(world, where)
    n_eval = rl.eval_prompts if rl.eval_every else 0
    unique = list({q.question: q for q in world.questions(
        TRAIN_QUESTIONS + 4 * n_eval, seed=cfg.train.seed)}.values())
    if len(unique) <= n_eval:
        raise ValueError(f"rl.world_docs={rl.world_docs} yields {len(unique)} distinct "
                         f"questions: too few for rl.eval_prompts={n_eval} held out")
    held_out, train = unique[:n_eval], unique[n_eval:n_eval + TRAIN_QUESTIONS]

    def prompt(q: Any, uid: str) -> Prompt:
        return Prompt(q.question, q.answer, uid, metadata={"facts": list(q.facts)})

    def agent(greedy: bool) -> Any:
        cls = {"react": ReActAgent, "itersynth": IterSynthAgent}[rl.agent]
        return cls(tokenizer, [LocalSearch(index), Visit(LocalPages(index))],
                   _agent_config(cfg, greedy))

    judge = build_judge(client_spec(rl.judge, aux_urls, "rl.judge") if rl.judge else None)
    rubric = RubricScorer(ClientConfig.from_dict(client_spec(rl.rubric, aux_urls, "rl.rubric"),
                                                 "rl.rubric")) if rl.rubric else None
    return Task(_cycle(train, prompt), [prompt(q, f"eval{i}") for i, q in enumerate(held_out)],
                agent(False), agent(True), lambda group: score_group(group, judge, rubric))


# -- pick_tokens -------------------------------------------------------------------------------

class OneMessageAgent(BaseAgent):
    """One engine call from a chat prompt, kept as generated (cut or not): for tasks scored on
    the tokens themselves."""

    role = "agent"

    async def run(self, question: str, reference: str | None, engine: RolloutEngine, *,
                  group_id: str, uid: str, resume: Resume | None = None,
                  commit: Commit | None = None) -> Trajectory:
        traj, _ = self.start(question, reference, group_id, uid, resume)
        if traj.turns:  # its one message was committed before a cut
            return traj
        context = self.chat.prompt_ids("", self.chat.safe_text(question))
        rid = f"{uid}/0"
        res = await engine.generate(GenerateRequest(
            rid, context, self.sampling_for(rid),
            return_routed_experts=self.config.return_routed_experts))
        traj.turns.append(Turn(self.role, context, list(res.output_ids),
                               list(res.output_logprobs), list(res.weight_versions),
                               finish_reason=res.finish_reason,
                               text=self.chat.decode(res.output_ids),
                               routed_experts=self.routed_experts(rid, res)))
        return traj


async def score_even_tokens(group: list[Trajectory]) -> None:
    for t in group:
        ids = [i for turn in t.turns for i in turn.output_ids]
        t.rewards["outcome"] = sum(i % 2 == 0 for i in ids) / max(len(ids), 1)


def pick_tokens_task(cfg: Config, tokenizer: Any, folder: Path,
                     aux_urls: dict[str, list[str]]) -> Task:
    words = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
    n_eval = cfg.rl.eval_prompts if cfg.rl.eval_every else 0

    def prompt(word: str, uid: str) -> Prompt:
        return Prompt(f"Write about {word}.", "", uid)

    return Task(_cycle(list(words), prompt),
                [prompt(f"{w} {i}", f"eval{i}") for i, w in enumerate(words[:n_eval])],
                OneMessageAgent(tokenizer, [], _agent_config(cfg, False)),
                OneMessageAgent(tokenizer, [], _agent_config(cfg, True)), score_even_tokens)


@dataclass
class Engines:
    """The policy engines, wherever they run: what agents call, where weight sync pushes."""

    policy: Any                       # a RolloutEngine
    urls: list[str]                   # the engine servers (weight sync's targets)
    aux_urls: dict[str, list[str]]    # aux pools' OpenAI base URLs (judge, summarizer, ...)
    schedule: Any                     # colocation: engines parked during a train step, or None
    core: Any                         # the in-process engine (its busy seconds), or None
    stop: Callable[[], None]

    async def end_loop(self) -> None:
        """An HttpEngine's session belongs to the event loop that opened it."""
        if self.core is not None:
            await self.policy.close()

    def busy_seconds(self) -> float | None:
        """Seconds the in-process engine spent generating so far (None for engine processes)."""
        return self.core.busy_seconds if self.core is not None else None


def start_engines(cfg: Config, spec: Any, tokenizer: Any) -> Engines:
    """One embedded engine in this process (`rollout.ray` off), else the engine pools Ray
    places (`launch_rollout`: engine processes that restart, SGLang on GPU, aux pools). Engines
    without `rollout.model_path` start from random weights of the policy's architecture: the
    first weight sync replaces them with the trainer's."""
    from megatron_rl.rollout.engines.http_client import HttpEngine

    ro = cfg.rollout
    if not ro.ray:
        import transformers

        from megatron_rl.rollout.engines.embedded import EmbeddedServer

        if ro.engine != "embedded" or ro.num_engines != 1 or ro.aux_pools:
            raise ValueError("rollout.engine=sglang, rollout.num_engines > 1 and "
                             "rollout.aux_pools need rollout.ray=true")
        model = transformers.AutoModelForCausalLM.from_config(spec.hf_config())
        server = EmbeddedServer(model, tokenizer, max_batch_size=ro.max_batch_size).start()
        return Engines(HttpEngine(server.url), [server.url], {}, None, server.core, server.stop)
    import ray

    from megatron_rl.distributed.ray_placement import init_ray
    from megatron_rl.rollout.engines.ray_engine import launch_rollout

    started = not ray.is_initialized() and ro.ray_address is None
    init_ray(ro)
    rollout = launch_rollout(ro, model_name=None if ro.model_path else cfg.model.name)

    def stop() -> None:
        rollout.close()
        if started:
            ray.shutdown()
    return Engines(rollout.policy, rollout.policy.urls(), rollout.aux_base_urls(),
                   rollout.schedule if rollout.placement.colocated else None, None, stop)


def client_spec(spec: dict[str, Any], aux_urls: dict[str, list[str]], where: str
                ) -> dict[str, Any]:
    """A judge spec whose `pool: NAME` is replaced by that aux pool's base URLs (Iris' in-cluster
    judge); other specs unchanged."""
    spec = dict(spec)
    pool = spec.pop("pool", None)
    if pool is None:
        return spec
    if pool not in aux_urls:
        raise ValueError(f"{where}.pool={pool!r}: no such rollout.aux_pools entry; started: "
                         f"{', '.join(aux_urls) or 'none'}")
    return {**spec, "base_url": aux_urls[pool]}
