"""Embedded engine with and without its prefix cache, on agents' request streams: the time to
serve the same episodes, and the greedy outputs compared. Goals: >= 1.15x on each stream.

The model is the quickstart's policy shape (`tiny-moe-agent` over its 34,048-id vocabulary, tied
embeddings), seeded and random. `--episodes` episodes are in flight, each `--turns` turns, each
turn submitted when the episode's last one finished, `--new-tokens` greedy tokens a turn:
- itersynth (the quickstart's shape): turns alternate a Planner prompt (a 176-token system
  prompt, the question, a summary) and a Synthesizer prompt (a 185-token one, the question, an
  observation); no prompt extends another.
- react: a 200-token system prompt and the question, then each turn's prompt is the last one,
  its output and a tool's answer (40-120 tokens).
Both engines serve the same model on one thread, interleaved, best of `--repeats`.

    taskset -c 0 .venv/bin/python benchmarks/prefix_cache.py [--model tiny-moe-agent]
        [--vocab 34048] [--streams itersynth,react]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import threading
import time
from typing import Any

import torch
from results import emit

from megatron_rl.engines.embedded_core import EmbeddedCore, Sampling, Seq
from megatron_rl.models.registry import get_model_spec

GOAL = 1.15


def episodes(shape: str, n: int, turns: int, vocab: int, seed: int
             ) -> list[list[list[int]]]:
    """Per episode, per turn: the prompt (itersynth) or the tokens added to the last turn's
    prompt and output (react; the first turn's: the whole prompt)."""
    rng = random.Random(seed)

    def toks(k: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(k)]

    planner, synthesizer, system = toks(176), toks(185), toks(200)
    out = []
    for _ in range(n):
        question = toks(rng.randint(15, 30))
        if shape == "react":
            out.append([system + question] + [toks(rng.randint(40, 120))
                                               for _ in range(turns - 1)])
        else:
            out.append([(planner if t % 2 == 0 else synthesizer) + question
                        + toks(rng.randint(20, 60) if t % 2 == 0 else rng.randint(120, 220))
                        for t in range(turns)])
    return out


def serve(core: EmbeddedCore, shape: str, eps: list[list[list[int]]], n: int, tag: str
          ) -> tuple[float, list[list[int]], int]:
    """(seconds, each episode's outputs, prompt tokens sent)."""
    outs: list[list[int]] = [[] for _ in eps]
    sent = [0] * len(eps)

    def episode(i: int) -> None:
        prompt: list[int] = []
        for t, part in enumerate(eps[i]):
            prompt = [*prompt, *part] if shape == "react" else list(part)
            s = Seq(rid=f"{tag}-{i}-{t}", prompt=list(prompt),
                    sampling=Sampling(temperature=0.0, max_new_tokens=n, min_new_tokens=n,
                                      ignore_eos=True),
                    return_logprob=True, return_routed=False,
                    future=concurrent.futures.Future())
            core.submit(s)
            got = s.future.result(timeout=600)["output_ids"]
            outs[i].extend(got)
            sent[i] += len(prompt)
            prompt += got

    t0 = time.perf_counter()
    threads = [threading.Thread(target=episode, args=(i,)) for i in range(len(eps))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t0, outs, sum(sent)


def measure(model: str = "tiny-moe-agent", vocab: int = 34048,
            streams: tuple[str, ...] = ("itersynth", "react"), n_episodes: int = 16,
            turns: int = 6, new_tokens: int = 24, repeats: int = 3, seed: int = 0
            ) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    cfg = get_model_spec(model).hf_config()
    cfg.vocab_size, cfg.tie_word_embeddings = vocab, True
    net = AutoModelForCausalLM.from_config(cfg).float().eval()
    cores = {"off": EmbeddedCore(net, prefix_cache=False, threads=1),
             "on": EmbeddedCore(net, threads=1)}
    for core in cores.values():
        core.start()
    print(f"{model} ({vocab} ids): {n_episodes} episodes x {turns} turns, {new_tokens} new "
          f"tokens a turn, one thread, best of {repeats}")
    res: dict[str, Any] = {}
    try:
        for shape in streams:
            eps = episodes(shape, n_episodes, turns, vocab, seed + 1)
            times: dict[str, list[float]] = {k: [] for k in cores}
            outs: dict[str, list[list[int]]] = {}
            for name, core in cores.items():  # warm: first-call allocations, lazy imports
                serve(core, shape, eps[:2], 2, f"warm-{shape}-{name}")
            for r in range(repeats):
                for name, core in cores.items():
                    if core.prefixes is not None:  # every repeat starts cold
                        core.call(core.flush_cache).result(timeout=60)
                        before = core.prefixes.info()
                    dt, outs[name], sent = serve(core, shape, eps, new_tokens,
                                                 f"{shape}-{name}-{r}")
                    times[name].append(dt)
            after = cores["on"].prefixes.info()
            saved = after["tokens_saved"] - before["tokens_saved"]
            ratio = min(times["off"]) / min(times["on"])
            same = sum(a == b for a, b in zip(outs["off"], outs["on"], strict=True))
            print(f"  {shape}: {sent} prompt tokens; without the prefix cache "
                  f"{min(times['off']):.2f} s, with it {min(times['on']):.2f} s: {ratio:.2f}x; "
                  f"{after['hits'] - before['hits']} prompts took a cached prefix, {saved} "
                  f"tokens not run ({saved / sent:.0%}); greedy outputs equal in "
                  f"{same}/{len(eps)} episodes")
            emit(f"prefix_cache_speedup_{shape}", ratio, GOAL, note=f"{model}, {shape} stream")
            res[shape] = {"ratio": ratio, "same": same, "saved": saved / sent}
    finally:
        for core in cores.values():
            core.stop()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-moe-agent")
    ap.add_argument("--vocab", type=int, default=34048)
    ap.add_argument("--streams", default="itersynth,react")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    measure(a.model, a.vocab, tuple(a.streams.split(",")), a.episodes, a.turns, a.new_tokens,
            a.repeats, a.seed)


if __name__ == "__main__":
    main()
