"""What `megatron-rl train` builds before its loop, on the embedded default: the generated world
and its search index, the training and held-out prompts, the agent and the rollout engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_rl.config.schema import Config
from megatron_rl.rollout.scheduler import Prompt

TRAIN_QUESTIONS = 64


def world_prompts(cfg: Config, folder: Path) -> tuple[Iterator[Prompt], list[Prompt], Path]:
    """The training prompts (cycled, in a fixed order: the checkpoint's data cursor counts
    them), held-out prompts no training prompt repeats, and the world's index folder."""
    from megatron_rl.data.world import build_world_index, generate_world

    world = generate_world(num_docs=cfg.rl.world_docs, seed=cfg.train.seed)
    where = folder / f"world-{cfg.rl.world_docs}-{cfg.train.seed}"  # deterministic: reusable
    index = where / "index" if (where / "index").is_dir() else build_world_index(world, where)
    n_eval = cfg.rl.eval_prompts if cfg.rl.eval_every else 0
    unique = list({q.question: q for q in world.questions(
        TRAIN_QUESTIONS + 4 * n_eval, seed=cfg.train.seed)}.values())
    if len(unique) <= n_eval:
        raise ValueError(f"rl.world_docs={cfg.rl.world_docs} yields {len(unique)} distinct "
                         f"questions: too few for rl.eval_prompts={n_eval} held out")
    held_out, train = unique[:n_eval], unique[n_eval:n_eval + TRAIN_QUESTIONS]

    def prompt(q: Any, uid: str) -> Prompt:
        return Prompt(q.question, q.answer, uid, metadata={"facts": list(q.facts)})

    def cycle() -> Iterator[Prompt]:
        for epoch in range(1 << 30):
            for i, q in enumerate(train):
                yield prompt(q, f"q{i}.e{epoch}")
    return cycle(), [prompt(q, f"eval{i}") for i, q in enumerate(held_out)], index


def build_agent(cfg: Config, tokenizer: Any, index: Path, *, greedy: bool = False) -> Any:
    from megatron_rl.agents import AgentConfig, IterSynthAgent, ReActAgent
    from megatron_rl.env.search import LocalSearch
    from megatron_rl.env.visit import LocalPages, Visit
    from megatron_rl.rollout.engines.base import SamplingParams

    rl = cfg.rl
    config = AgentConfig(max_turns=rl.max_turns, max_context_tokens=cfg.model.seq_length,
                         sampling=SamplingParams(temperature=0.0 if greedy else rl.temperature,
                                                 max_new_tokens=rl.max_new_tokens),
                         seed=cfg.train.seed, return_routed_experts=rl.routing_replay)
    cls = {"react": ReActAgent, "itersynth": IterSynthAgent}[rl.agent]
    return cls(tokenizer, [LocalSearch(index), Visit(LocalPages(index))], config)


def start_engine(cfg: Config, spec: Any, tokenizer: Any) -> Any:
    """An embedded engine with random weights of the policy's architecture: the first weight
    sync replaces them with the trainer's."""
    import transformers

    from megatron_rl.rollout.engines.embedded import EmbeddedServer

    model = transformers.AutoModelForCausalLM.from_config(spec.hf_config())
    return EmbeddedServer(model, tokenizer, max_batch_size=cfg.rollout.max_batch_size).start()
