"""Partial rollout vs synchronous rollout: wall time per RL step, heavy-tailed generation lengths.

Distribution. Each sample's number of assistant messages N is a discrete Pareto draw:
N = min(cap, floor(U ** (-1 / alpha))), U uniform in (0, 1] from a hash of (seed, prompt uid,
sample index), so P(N >= k) = k ** -alpha for 1 <= k <= cap. Defaults alpha = 1.2, cap = 32:
median 1, mean 3.1, P(N >= 8) ~ 8 %, P(N = 32) ~ 1.6 %. Every message is one engine call of
exactly `--tokens` (16) new tokens (`ignore_eos`), so a sample generates 16 N tokens; its
context grows ReAct-style by each output plus a short observation, so late messages also
prefill longer contexts. The draw is the same in both modes (same prompt stream, same keys).

Method. One process runs the real stack: a `RolloutScheduler` with its rollout forest, the
`RuleJudge`, an agent defined here (`HeavyTailAgent`: implements the `Agent` protocol, commits
after every finished message and continues from `resume=(traj, state)`), and the embedded
engine (continuous batching, real tokens from the random-weight `tiny-moe`). The scheduler
speaks to it through the client the RL driver uses for an embedded engine in its process
(`InProcessEngine`: POST /generate's body and answer without the HTTP round trip);
`--client http` puts `HttpEngine` in its place, whose server thread then shares this process's
interpreter with the engine (no deployment does that: an engine behind HTTP runs in its own
process). Two schedulers share the engine and are stepped alternately (sync, partial; then
partial, sync; ...) so load from other processes hits both alike:

- synchronous: oversample 1.0, no partial rollout: a step waits for all its groups;
- partial:     oversample 2.0, partial rollout: the step ends once `groups_per_step` groups are
  done; the cut sessions resume next step from their last committed message.

Both train `groups_per_step` groups (x `samples` trajectories) every step; dynamic sampling is
off. A step's wall time is `collect(step)` (what an RL step waits on) plus making sure the cut
left nothing decoding on the engine (the scheduler's cut aborts the requests of the sessions
it cancels and waits for their answers; a request still on the engine after `collect` would
be aborted here, in the step's time, and counted as a leftover). After every collect the
engine's weight version is bumped (`/update_weight_version`, no tensors), so a resumed
trajectory splices tokens of an older version: the stale share is reported.
Token accounting counts every token the engine sampled: generated = trained + still pending in
the forest (trained later) + lost (the in-flight messages a cut threw away).

    python benchmarks/partial_rollout.py [--steps 30 --groups 4 --samples 4 --alpha 1.2]
                                         # ~1.5 min on 2 idle cores, more when they are busy
    python benchmarks/partial_rollout.py --quick     # a few seconds: the smoke-test size
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

MODES = {"sync": (1.0, False), "partial": (2.0, True)}  # oversample, partial_rollout
OBSERVATION = "<tool_response>ok</tool_response>"


@dataclass
class BenchConfig:
    steps: int = 30            # measured steps per mode (a capped sample: ~1 sync step in 4)
    warmup: int = 1            # unmeasured first steps per mode
    groups: int = 4            # groups_per_step
    samples: int = 4           # samples_per_prompt
    alpha: float = 1.2         # Pareto shape of the messages per sample
    cap: int = 32              # most messages per sample
    tokens: int = 16           # new tokens per message (ignore_eos)
    seed: int = 0
    threads: int = 1           # torch threads of the engine
    client: str = "in-process"  # or "http": how the schedulers reach the engine


def pareto_messages(alpha: float, cap: int, seed: int, prompt_uid: str, index: int) -> int:
    """The messages of sample `index` of prompt `prompt_uid`: P(N >= k) = k^-alpha, N <= cap."""
    u = 1.0 - random.Random(f"{seed}:{prompt_uid}:{index}").random()  # (0, 1]
    return max(1, min(cap, math.floor(u ** (-1.0 / alpha))))


def distribution_stats(alpha: float, cap: int) -> dict[str, float]:
    tail = [k ** -alpha for k in range(1, cap + 1)]  # P(N >= k)
    return {"mean": sum(tail), "p_ge_8": 8 ** -alpha if cap >= 8 else 0.0,
            "p_cap": tail[-1], "median": max(k for k in range(1, cap + 1) if tail[k - 1] >= .5)}


class HeavyTailAgent:
    """One growing conversation of N messages (N from `pareto_messages`), each one engine call
    of exactly `tokens` tokens; commits after every message but the last and resumes from the
    committed context. Answers 'even'/'odd' by the parity of its tokens (the judge's reward)."""

    def __init__(self, tokenizer: Any, cfg: BenchConfig, tag: str):
        from megatron_rl.engines.base import SamplingParams

        self.tok, self.cfg, self.tag = tokenizer, cfg, tag
        self.sampling = SamplingParams(temperature=1.0, max_new_tokens=cfg.tokens,
                                       ignore_eos=True)
        self.observation = tokenizer.encode(OBSERVATION, add_special_tokens=False)

    async def run(self, question: str, reference: str | None, engine: Any, *, group_id: str,
                  uid: str, resume: Any = None, commit: Any = None) -> Any:
        import dataclasses

        from megatron_rl.engines.base import GenerateRequest
        from megatron_rl.records.trajectory import Trajectory, Turn

        if resume is None:
            index = int(uid.rsplit("/", 1)[1])  # the scheduler's uid: prompt/s{step}/{index}
            traj = Trajectory(uid=uid, group_id=group_id, question=question,
                              reference=reference)
            # note: "done" is the scheduler's key for a finished session; not used here
            state = {"index": index, "message": 0,
                     "messages": pareto_messages(self.cfg.alpha, self.cfg.cap, self.cfg.seed,
                                                 group_id, index),
                     "context": self.tok.encode(question, add_special_tokens=False)}
        else:
            traj, state = resume
        context = list(state["context"])
        for m in range(state["message"], state["messages"]):
            rid = f"{self.tag}:{traj.uid}/{len(traj.turns)}"
            # the same sample draws the same tokens in both modes
            seed = zlib.crc32(f"{self.cfg.seed}:{group_id}/{state['index']}/{m}".encode())
            res = await engine.generate(GenerateRequest(
                rid, context, dataclasses.replace(self.sampling, seed=seed)))
            if res.finish_reason == "abort":  # only cut sessions are aborted, and they are gone
                raise RuntimeError(f"request {rid} was aborted under a live client")
            last = m == state["messages"] - 1
            obs = [] if last else list(self.observation)
            traj.turns.append(Turn("agent", list(context), list(res.output_ids),
                                   list(res.output_logprobs), list(res.weight_versions),
                                   observation_ids=obs, finish_reason=res.finish_reason))
            context = context + list(res.output_ids) + obs
            if not last and commit is not None:
                commit(traj, {**state, "message": m + 1, "context": context})
        parity = sum(t for turn in traj.turns for t in turn.output_ids) % 2
        traj.answer = "odd" if parity else "even"
        return traj


def prompt_stream() -> Iterator[Any]:
    from megatron_rl.records.prompt import Prompt

    k = 0
    while True:
        yield Prompt(f"Question {k}: is the sum of your tokens even?", "even", f"q{k}")
        k += 1


@dataclass
class StepRecord:
    step: int
    wall_s: float
    groups: int
    generated: int             # tokens the engine sampled during the step
    trained: int               # output tokens of the kept trajectories
    stale: int                 # of which sampled under an older weight version
    pending_before: int        # tokens committed in the forest, not trained yet
    pending_after: int
    resumed: int               # samples continued from a committed prefix
    cancelled: int             # groups cut and requeued
    messages: list[int] = field(default_factory=list)  # per trained sample
    drawn: list[int] = field(default_factory=list)     # its draw (= messages when resumed right)
    sequences: list[int] = field(default_factory=list)  # training sequences per trajectory
    passes: int = 0            # engine forward passes (prefills + decode steps) in the step
    prefill_s: float = 0.0     # engine time in prefill passes
    decode_s: float = 0.0      # engine time in decode passes
    prefill_slots: int = 0     # prefill positions computed (rows x the longest context)
    prefill_tokens: int = 0    # of which real tokens (the rest is left padding)
    leftovers: int = 0         # requests still on the engine when collect returned

    @property
    def lost(self) -> int:
        return self.pending_before + self.generated - self.trained - self.pending_after


@dataclass
class ModeResult:
    mode: str
    oversample: float
    partial: bool
    warmup: list[StepRecord]
    steps: list[StepRecord]

    def total(self, name: str) -> int:
        return sum(getattr(r, name) for r in self.steps)

    @property
    def wall(self) -> list[float]:
        return [r.wall_s for r in self.steps]


def forest_tokens(forest: Any) -> int:
    return sum(len(t["output_ids"]) for n in forest.nodes.values() for t in n.turns)


class EngineMeter:
    """What the engine did: every token it sampled (prefill's first token and each decode
    step), its forward passes, their time (prefill / decode) and prefill's padding."""

    FIELDS = ("n", "passes", "prefill_s", "decode_s", "prefill_slots", "prefill_tokens")

    def __init__(self, core: Any):
        for name in self.FIELDS:
            setattr(self, name, 0)
        self.prefilling = False
        sample, forward = core._sample, core._forward
        prefill_rows, prefix_kv = core._prefill_rows, core._prefix_kv

        def counted(seqs: list[Any], logits: Any) -> None:
            self.n += len(seqs)
            self.passes += 1
            sample(seqs, logits)

        def timed(*args: Any, **kwargs: Any) -> Any:  # (..., decode=True) on decode steps
            t0 = time.perf_counter()
            out = forward(*args, **kwargs)
            if self.prefilling:
                self.prefill_s += time.perf_counter() - t0
            else:
                self.decode_s += time.perf_counter() - t0
            return out

        def prefilling(fn: Any, *args: Any) -> Any:
            self.prefilling = True
            try:
                return fn(*args)
            finally:
                self.prefilling = False

        def prefilled(seqs: list[Any], toks: list[list[int]], cached: list[int],
                      kvs: list[Any]) -> Any:
            # what the pass runs: rows x its longest suffix after each row's cached prefix
            sufs = [len(t) - c for t, c in zip(toks, cached, strict=True)]
            self.prefill_slots += len(toks) * max(sufs)
            self.prefill_tokens += sum(sufs)
            return prefilling(prefill_rows, seqs, toks, cached, kvs)

        def prefix(key: tuple[int, ...], base: tuple[int, ...]) -> Any:
            self.prefill_slots += len(key) - len(base)
            self.prefill_tokens += len(key) - len(base)
            return prefilling(prefix_kv, key, base)

        core._sample, core._forward = counted, timed
        core._prefill_rows, core._prefix_kv = prefilled, prefix

    def snapshot(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.FIELDS}


async def _abort_leftovers(engine: Any, core: Any) -> int:
    """Make sure the cut left nothing decoding on the engine; returns the requests it found.

    The scheduler's cut aborts the requests of the sessions it cancels and waits for their
    answers, so when `collect` returns every request the step sent has been answered: none
    is in transit, and none should be left. One that is (a cut that dropped its calls) is
    aborted here, and the polling counts in the step's time."""
    found = len(core.rids) + len(core.pending)
    for _ in range(50):
        if not core.rids and not core.pending:
            return found
        await engine.request("POST", "/abort_request", {"abort_all": True})
        await asyncio.sleep(0.005)
    raise RuntimeError(f"engine requests still in flight after the cut: {sorted(core.rids)}")


async def _step(sched: Any, engine: Any, core: Any, meter: EngineMeter,
                step: int) -> StepRecord:
    version = engine.weight_version
    pending0, before = forest_tokens(sched.forest), meter.snapshot()
    t0 = time.perf_counter()
    out = await sched.collect(step)
    leftovers = await _abort_leftovers(engine, core)
    wall = time.perf_counter() - t0
    did = {k: v - before[k] for k, v in meter.snapshot().items()}
    trajs, c = out.trajectories, sched.agent.cfg
    outputs = [(t, v) for traj in trajs for turn in traj.turns
               for t, v in zip(turn.output_ids, turn.weight_versions)]
    return StepRecord(step, wall, len(out.groups), int(did["n"]), len(outputs),
                      sum(v < version for _, v in outputs), pending0,
                      forest_tokens(sched.forest), out.resumed_samples, out.cancelled_prompts,
                      [len(t.turns) for t in trajs],
                      [pareto_messages(c.alpha, c.cap, c.seed, t.group_id,
                                       int(t.uid.rsplit("/", 1)[1])) for t in trajs],
                      [len(t.sequences()) for t in trajs], int(did["passes"]), did["prefill_s"],
                      did["decode_s"], int(did["prefill_slots"]), int(did["prefill_tokens"]),
                      leftovers)


async def _run(cfg: BenchConfig, server: Any, meter: EngineMeter, tokenizer: Any
               ) -> dict[str, ModeResult]:
    from megatron_rl.engines.embedded import InProcessEngine
    from megatron_rl.engines.http_client import HttpEngine
    from megatron_rl.rewards.composite import score_group
    from megatron_rl.rewards.rule import RuleJudge
    from megatron_rl.rollout.scheduler import RolloutScheduler, SchedulerConfig

    engine = InProcessEngine(server) if cfg.client == "in-process" else HttpEngine(server.url)
    judge = RuleJudge()
    scheds, results = {}, {}
    for mode, (oversample, partial) in MODES.items():
        scheds[mode] = RolloutScheduler(
            HeavyTailAgent(tokenizer, cfg, mode), engine, prompt_stream(),
            lambda g: score_group(g, judge),
            SchedulerConfig(samples_per_prompt=cfg.samples, groups_per_step=cfg.groups,
                            oversample=oversample, dynamic_sampling=False,
                            partial_rollout=partial))
        results[mode] = ModeResult(mode, oversample, partial, [], [])
    try:
        version = 0
        for step in range(cfg.warmup + cfg.steps):
            order = list(MODES) if step % 2 == 0 else list(MODES)[::-1]
            for mode in order:
                rec = await _step(scheds[mode], engine, server.core, meter, step)
                res = results[mode]
                (res.warmup if step < cfg.warmup else res.steps).append(rec)
                version += 1  # a policy update after every step: resumed prefixes go stale
                await engine.update_weights_from_tensors([], weight_version=version)
    finally:
        await engine.close()
    return results


def run_benchmark(cfg: BenchConfig) -> dict[str, ModeResult]:
    """Start the embedded engine, run both modes interleaved, stop the engine."""
    import torch
    import transformers

    from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
    from megatron_rl.engines.embedded import EmbeddedServer
    from megatron_rl.models.registry import get_model_spec

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    spec = get_model_spec("tiny-moe")
    tokenizer = tiny_qwen3_tokenizer(vocab_size=spec.vocab_size)
    model = transformers.AutoModelForCausalLM.from_config(spec.hf_config())
    # every sample of every running group at once: 2 x groups x samples rows in partial mode
    server = EmbeddedServer(model, tokenizer,
                            max_batch_size=max(32, 2 * cfg.groups * cfg.samples),
                            threads=cfg.threads).start()
    try:
        return asyncio.run(_run(cfg, server, EngineMeter(server.core), tokenizer))
    finally:
        server.stop()


def bootstrap_ratio(a: list[float], b: list[float], n: int = 2000) -> tuple[float, float]:
    """2.5 and 97.5 percentiles of mean(a) / mean(b), steps resampled with replacement."""
    rng = random.Random(0)
    ratios = sorted(statistics.mean(rng.choices(a, k=len(a))) /
                    statistics.mean(rng.choices(b, k=len(b))) for _ in range(n))
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def report(cfg: BenchConfig, results: dict[str, ModeResult], goal: float = 0.6) -> float:
    d = distribution_stats(cfg.alpha, cfg.cap)
    print(f"distribution: messages per sample N = min({cfg.cap}, floor(U^(-1/{cfg.alpha:g}))), "
          f"discrete Pareto P(N >= k) = k^-{cfg.alpha:g} on [1, {cfg.cap}], keyed by (prompt "
          f"uid, sample index, seed {cfg.seed}); median {d['median']}, mean {d['mean']:.2f}, "
          f"P(N >= 8) {100 * d['p_ge_8']:.1f} %, P(N = {cfg.cap}) {100 * d['p_cap']:.1f} %; "
          f"{cfg.tokens} tokens per message (ignore_eos), then the observation {OBSERVATION!r}")
    print(f"setup: embedded engine (tiny-moe, random weights, {cfg.threads} torch thread(s)), "
          f"{cfg.client} client; {cfg.groups} groups x {cfg.samples} samples per step; {cfg.steps} "
          f"measured steps per mode after {cfg.warmup} warm-up; modes interleaved step by step; "
          f"weight version bumped after every collect")
    print(f"{'mode':8s} {'oversample':>10s} {'partial':>7s} {'step s mean':>11s} "
          f"{'median':>6s} {'max':>6s} {'groups/step':>11s} {'msgs/traj':>9s} "
          f"{'trained tok/s':>13s}")
    for r in results.values():
        msgs = [m for x in r.steps for m in x.messages]
        print(f"{r.mode:8s} {r.oversample:10.1f} {r.partial!s:>7s} "
              f"{statistics.mean(r.wall):11.2f} {statistics.median(r.wall):6.2f} "
              f"{max(r.wall):6.2f} {','.join(map(str, sorted({x.groups for x in r.steps}))):>11s} "
              f"{statistics.mean(msgs):9.2f} {r.total('trained') / sum(r.wall):13.0f}")
    print(f"{'tokens':8s} {'generated':>10s} {'trained':>8s} {'pending':>8s} {'lost':>6s} "
          f"{'lost %':>6s} {'stale':>6s} {'stale %':>7s} {'resumed':>7s} {'cut groups':>10s} "
          f"{'leftovers':>9s}")
    for r in results.values():
        gen, trained = r.total("generated"), r.total("trained")
        print(f"{r.mode:8s} {gen:10d} {trained:8d} "
              f"{r.steps[-1].pending_after - r.steps[0].pending_before:+8d} "
              f"{r.total('lost'):6d} {100 * r.total('lost') / max(gen, 1):6.1f} "
              f"{r.total('stale'):6d} {100 * r.total('stale') / max(trained, 1):7.1f} "
              f"{r.total('resumed'):7d} {r.total('cancelled'):10d} {r.total('leftovers'):9d}")
    print(f"{'engine':8s} {'passes/step':>11s} {'rows/pass':>9s} {'prefill s':>9s} "
          f"{'decode s':>8s} {'prefill pad %':>13s}   (per step; pad: left padding to the "
          f"longest context of a prefill)")
    for r in results.values():
        n = len(r.steps)
        slots = r.total("prefill_slots")
        print(f"{r.mode:8s} {r.total('passes') / n:11.0f} "
              f"{r.total('generated') / max(r.total('passes'), 1):9.1f} "
              f"{r.total('prefill_s') / n:9.2f} {r.total('decode_s') / n:8.2f} "
              f"{100 * (slots - r.total('prefill_tokens')) / max(slots, 1):13.1f}")
    for r in results.values():
        print(f"{r.mode:8s} step wall s: " + " ".join(f"{w:.2f}" for w in r.wall))
    print("pending: change over the measured steps of the tokens committed in the forest, not "
          "trained yet; lost: in-flight messages a cut threw away; stale: trained tokens "
          "sampled under an older weight version than the step's; leftovers: requests still "
          "on the engine when collect returned")
    sync, part = results["sync"], results["partial"]
    ratio = statistics.mean(part.wall) / statistics.mean(sync.wall)
    med = statistics.median(part.wall) / statistics.median(sync.wall)
    tput = (part.total("trained") / sum(part.wall)) / (sync.total("trained") / sum(sync.wall))
    passes = (part.total("passes") / len(part.steps)) / (sync.total("passes") / len(sync.steps))
    print(f"partial / sync, engine forward passes per step: {passes:.3f} (the step-time ratio "
          f"if a pass cost the same whatever its rows)")
    lo, hi = bootstrap_ratio(part.wall, sync.wall)
    print(f"partial / sync, mean step wall time: {ratio:.3f} (95 % bootstrap over steps "
          f"{lo:.2f}-{hi:.2f}; ratio of medians {med:.3f}); "
          f"throughput (trained tok/s) x{tput:.2f}; goal <= {goal}: "
          f"{'PASS' if ratio <= goal else 'MISS'}")
    return ratio


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="measured steps per mode (30)")
    p.add_argument("--groups", type=int, default=None, help="groups_per_step (4)")
    p.add_argument("--samples", type=int, default=None, help="samples_per_prompt (4)")
    p.add_argument("--alpha", type=float, default=None, help="Pareto shape (1.2)")
    p.add_argument("--cap", type=int, default=None, help="most messages per sample (32)")
    p.add_argument("--tokens", type=int, default=None, help="new tokens per message (16)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured steps per mode (1)")
    p.add_argument("--seed", type=int, default=None, help="draws and sampling seeds (0)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    p.add_argument("--client", choices=("in-process", "http"), default="in-process",
                   help="the driver's in-process client, or HTTP to a server in this process")
    p.add_argument("--quick", action="store_true", help="smoke-test size (a few seconds)")
    a = p.parse_args()
    cfg = quick_config() if a.quick else BenchConfig()
    for name in ("steps", "groups", "samples", "alpha", "cap", "tokens", "warmup", "seed"):
        if getattr(a, name) is not None:
            setattr(cfg, name, getattr(a, name))
    cfg.threads, cfg.client = a.threads, a.client
    from results import emit  # benchmarks/ is on the path when run as a script

    emit("partial rollout / synchronous step time", report(cfg, run_benchmark(cfg)), 0.6,
         better="lower")


def quick_config() -> BenchConfig:
    """2 groups x 2 samples, at most 8 messages of 4 tokens, 1 + 3 steps. Seed 2 draws the
    groups' longest samples q0: 1, q1: 6, q2: 1, q3: 8, q4: 4, q5: 2, q6: 1, q7: 5 messages:
    partial mode keeps q0, q2 then q5, q4, cutting q1 and q3 twice (the second time with
    messages committed), so step 2 trains q6 and a resumed group holding older versions."""
    return BenchConfig(steps=3, warmup=1, groups=2, samples=2, cap=8, tokens=4, seed=2)


if __name__ == "__main__":
    main()
