"""Embedded engine with and without its prefix cache, on an agent's request stream: the time
to serve the same episodes, and the greedy outputs compared. Goal: >= 1.15x.

The model is the quickstart's policy shape (`tiny-moe-agent` over its 34,048-id vocabulary, tied
embeddings), seeded and random. The stream is IterSynth's shape in the quickstart: `--episodes`
episodes in flight, each `--turns` turns that alternate a Planner prompt (a 176-token system
prompt, the question, a summary) and a Synthesizer prompt (a 185-token one, the question, an
observation), each turn submitted when the episode's last one finished, `--new-tokens` greedy
tokens a turn. Both engines serve the same model on one thread, interleaved, best of
`--repeats`.

    taskset -c 0 .venv/bin/python benchmarks/prefix_cache.py [--model tiny-moe-agent]
        [--vocab 34048]
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


def episodes(n: int, turns: int, vocab: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)

    def toks(k: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(k)]

    planner, synthesizer = toks(176), toks(185)
    out = []
    for _ in range(n):
        question = toks(rng.randint(15, 30))
        out.append([(planner if t % 2 == 0 else synthesizer) + question
                    + toks(rng.randint(20, 60) if t % 2 == 0 else rng.randint(120, 220))
                    for t in range(turns)])
    return out


def serve(core: EmbeddedCore, eps: list[list[list[int]]], n: int, tag: str
          ) -> tuple[float, list[list[int]]]:
    outs: list[list[int]] = [[] for _ in eps]

    def episode(i: int) -> None:
        for t, prompt in enumerate(eps[i]):
            s = Seq(rid=f"{tag}-{i}-{t}", prompt=list(prompt),
                    sampling=Sampling(temperature=0.0, max_new_tokens=n, min_new_tokens=n,
                                      ignore_eos=True),
                    return_logprob=True, return_routed=False,
                    future=concurrent.futures.Future())
            core.submit(s)
            outs[i].extend(s.future.result(timeout=600)["output_ids"])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=episode, args=(i,)) for i in range(len(eps))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t0, outs


def measure(model: str = "tiny-moe-agent", vocab: int = 34048, n_episodes: int = 16,
            turns: int = 6, new_tokens: int = 24, repeats: int = 3, seed: int = 0
            ) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    cfg = get_model_spec(model).hf_config()
    cfg.vocab_size, cfg.tie_word_embeddings = vocab, True
    net = AutoModelForCausalLM.from_config(cfg).float().eval()
    eps = episodes(n_episodes, turns, int(net.config.vocab_size), seed + 1)
    cores = {"off": EmbeddedCore(net, prefix_cache=False, threads=1),
             "on": EmbeddedCore(net, threads=1)}
    times: dict[str, list[float]] = {k: [] for k in cores}
    outs: dict[str, list[list[int]]] = {}
    for core in cores.values():
        core.start()
    try:
        for name, core in cores.items():  # warm: first-call allocations, lazy imports
            serve(core, eps[:2], 2, f"warm-{name}")
        for r in range(repeats):
            for name, core in cores.items():
                if core.prefixes is not None:
                    core.call(core.flush_cache).result(timeout=60)  # every repeat starts cold
                    before = core.prefixes.info()
                dt, outs[name] = serve(core, eps, new_tokens, f"{name}-{r}")
                times[name].append(dt)
        after = cores["on"].prefixes.info()
        info = {k: after[k] - before[k] for k in ("hits", "tokens_saved", "tokens_computed")}
        info["entries"] = after["entries"]
    finally:
        for core in cores.values():
            core.stop()
    prompt_tokens = sum(len(p) for ep in eps for p in ep)
    ratio = min(times["off"]) / min(times["on"])
    same = sum(a == b for a, b in zip(outs["off"], outs["on"], strict=True))
    print(f"{model} ({vocab} ids): {n_episodes} episodes x {turns} turns, {prompt_tokens} "
          f"prompt tokens, {new_tokens} new tokens a turn, one thread, best of {repeats}")
    print(f"  without the prefix cache {min(times['off']):.2f} s, with it "
          f"{min(times['on']):.2f} s: {ratio:.2f}x; greedy outputs equal in {same}/{len(eps)} "
          f"episodes")
    share = info["tokens_saved"] / prompt_tokens
    print(f"  last repeat: {info['hits']} prompts took a cached prefix, "
          f"{info['tokens_saved']} of their tokens not run ({share:.0%} of all), "
          f"{info['tokens_computed']} run to build {info['entries']} prefixes")
    emit("prefix_cache_speedup", ratio, GOAL, note=f"{model}, agent stream")
    return {"ratio": ratio, "same": same, "info": info}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-moe-agent")
    ap.add_argument("--vocab", type=int, default=34048)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    measure(a.model, a.vocab, a.episodes, a.turns, a.new_tokens, a.repeats, a.seed)


if __name__ == "__main__":
    main()
