"""The embedded engine's output layer (`engines/output_layer.py`): F.linear on the [vocab,
hidden] weight against the transposed copy, alone and inside the engine. Goals: the engine
serves an RL step's tail (3 episodes of the quickstart's IterSynth shape) >= 1.15x faster with
it, and a full batch (16 episodes) no slower (>= 0.95x).

The layer alone: F.linear and the copy, ms per call at 1-32 rows, one thread, the quickstart's
34,048 x 128 shape, and whether the copy's logits are bit for bit F.linear's (the layer uses
the copy below 4 rows only). The engine: two engines on copies of one seeded random
`tiny-moe-agent` (tied embeddings), one with `fast_output_layer` and one without, serve
`benchmarks/prefix_cache.py`'s IterSynth stream (alternating Planner and Synthesizer prompts,
80 greedy tokens a turn), interleaved with the order swapped each repeat, best of
`--repeats`; the outputs are compared. 3 episodes: an RL step's tail, where most of its
decode steps run (the quickstart's RL stage, 3 steps: 33 % of its 4,348 decode steps had 1-3
rows, 4 % had 16).

    taskset -c 0 .venv/bin/python benchmarks/output_layer.py [--vocab 34048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from prefix_cache import episodes, serve
from results import emit

from megatron_rl.engines.embedded_core import EmbeddedCore
from megatron_rl.engines.output_layer import COPY_BELOW_ROWS, TransposedOutputLayer
from megatron_rl.models.registry import get_model_spec

GOALS = {3: 1.15, 16: 0.95}  # episodes in flight -> the speed-up asked


def per_call_ms(f, calls: int = 100) -> float:
    for _ in range(5):
        f()
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t0) / calls * 1e3


def layer_alone(vocab: int, hidden: int) -> None:
    """F.linear against the copy at each row count: where the copy pays is the host's."""
    w = torch.nn.Parameter(torch.randn(vocab, hidden) * 0.1, requires_grad=False)
    wt = w.detach().t().contiguous()
    layer = TransposedOutputLayer(w)
    print(f"output layer {vocab} x {hidden}, one thread: ms per call (the layer uses the copy "
          f"below {COPY_BELOW_ROWS} rows, F.linear from there)")
    print("| rows | F.linear | copy | speed-up | copy's logits = F.linear's |")
    print("|---|---|---|---|---|")
    with torch.no_grad():
        for rows in (1, 2, 3, 4, 8, 16, 32):
            x = torch.randn(rows, hidden)
            a = per_call_ms(lambda x=x: torch.nn.functional.linear(x, w))
            b = per_call_ms(lambda x=x: x @ wt)
            same = torch.equal(x @ wt, torch.nn.functional.linear(x, w))
            assert torch.equal(layer(x), x @ wt if rows < COPY_BELOW_ROWS
                               else torch.nn.functional.linear(x, w))
            print(f"| {rows} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {same} |")


def engine(vocab: int, repeats: int, new_tokens: int, n_episodes: int, seed: int) -> float:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = get_model_spec("tiny-moe-agent").hf_config()
    cfg.vocab_size, cfg.tie_word_embeddings = vocab, True
    net = AutoModelForCausalLM.from_config(cfg).float().eval()
    plain = copy.deepcopy(net)
    cores = {"F.linear": EmbeddedCore(plain, threads=1),
             "transposed": EmbeddedCore(net, threads=1, fast_output_layer=True)}
    eps = episodes("itersynth", n_episodes, 6, vocab, seed + 1)
    times: dict[str, list[float]] = {k: [] for k in cores}
    outs = {}
    for core in cores.values():
        core.start()
    try:
        for name, core in cores.items():  # warm
            serve(core, "itersynth", eps[:2], 2, f"warm-{name}")
        for r in range(repeats):
            # each repeat swaps who goes first: no engine always runs right after the other
            for name, core in list(cores.items())[::1 if r % 2 == 0 else -1]:
                core.call(core.flush_cache).result(timeout=60)
                dt, outs[name], _ = serve(core, "itersynth", eps, new_tokens, f"{name}-{r}")
                times[name].append(dt)
    finally:
        for core in cores.values():
            core.stop()
    ratio = min(times["F.linear"]) / min(times["transposed"])
    same = sum(a == b for a, b in zip(outs["F.linear"], outs["transposed"], strict=True))
    print(f"engine, IterSynth stream ({n_episodes} episodes x 6 turns, {new_tokens} greedy "
          f"tokens a turn, one thread): F.linear {min(times['F.linear']):.2f} s, transposed "
          f"{min(times['transposed']):.2f} s: {ratio:.2f}x; greedy outputs equal in "
          f"{same}/{len(eps)} episodes")
    if n_episodes in GOALS:
        emit(f"output_layer_engine_speedup_{n_episodes}_episodes", ratio, GOALS[n_episodes],
             note=f"tiny-moe-agent, {vocab} ids, IterSynth stream")
    return ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=34048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=80)
    ap.add_argument("--episodes", default="3,16", help="episodes in flight, one run each")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    layer_alone(a.vocab, get_model_spec("tiny-moe-agent").hidden_size)
    for n in (int(e) for e in a.episodes.split(",")):
        engine(a.vocab, a.repeats, a.new_tokens, n, a.seed)


if __name__ == "__main__":
    main()
