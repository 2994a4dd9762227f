"""Embedded engine vs `transformers.generate`: greedy decode throughput (output tokens/s) on the
same model and prompts. Goal: engine >= 1.5x generate on a mixed-length batch, >= 1.0x at batch 1.

Both sides: one seeded tiny model (fp32, eval), greedy, exactly `--new-tokens` tokens per
prompt (min_new_tokens = max_new_tokens). `generate` gets the batch left-padded with an
attention mask, as a user of HF would pass it; the engine (`EmbeddedCore`, in process, no HTTP)
gets every prompt submitted at once. Each case is timed `--repeats` times, interleaved, best
run kept (the machine may be shared). Greedy outputs are compared sequence by sequence: fp32
reductions over differently padded batches can break near-ties, so a few may differ.

    taskset -c 0 .venv/bin/python benchmarks/engine_vs_generate.py [--model tiny-moe]
        [--batch 16] [--new-tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import time
from typing import Any

import torch
from results import emit

from megatron_rl.engines.embedded_core import EmbeddedCore, Sampling, Seq
from megatron_rl.models.registry import get_model_spec

GOAL_MIXED, GOAL_SINGLE = 1.5, 1.0


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(get_model_spec(name).hf_config()).float().eval()


def make_prompts(batch: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(batch)]


@torch.no_grad()
def run_generate(model: torch.nn.Module, prompts: list[list[int]], n: int
                 ) -> tuple[list[list[int]], float]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=0)
    dt = time.perf_counter() - t0
    return out[:, width:].tolist(), dt


def run_engine(core: EmbeddedCore, prompts: list[list[int]], n: int, tag: str
               ) -> tuple[list[list[int]], float]:
    seqs = [Seq(rid=f"{tag}-{i}", prompt=list(p),
                sampling=Sampling(temperature=0.0, max_new_tokens=n, min_new_tokens=n,
                                  ignore_eos=True),
                return_logprob=False, return_routed=False, future=concurrent.futures.Future())
            for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for s in seqs:
        core.submit(s)
    outs = [s.future.result(timeout=600)["output_ids"] for s in seqs]
    return outs, time.perf_counter() - t0


def measure(model: str = "tiny-moe", batch: int = 16, new_tokens: int = 64, threads: int = 1,
            repeats: int = 5, min_len: int = 8, max_len: int = 200, seed: int = 0,
            verbose: bool = True) -> dict[str, Any]:
    """Runs both cases; returns {"cases": {name: row}, "ratio_mixed", "ratio_single", "pass"}."""
    torch.set_num_threads(threads)
    net = build_model(model, seed)
    vocab = int(net.config.vocab_size)
    mixed = make_prompts(batch, min_len, max_len, vocab, seed + 1)
    cases = {f"mixed x{batch}": mixed, "batch 1": mixed[:1]}
    core = EmbeddedCore(net, max_batch_size=max(32, batch), threads=threads)
    core.start()
    rows: dict[str, dict[str, Any]] = {}
    try:
        # the engine's thread runs the model: give it the same intra-op thread count
        core.call(lambda: torch.set_num_threads(threads)).result(timeout=60)
        run_engine(core, mixed[:2], 4, "warm")  # first-call allocations, lazy imports
        run_generate(net, mixed[:2], 4)
        for name, prompts in cases.items():
            gen_s, eng_s = [], []
            for r in range(repeats):
                ref, dt = run_generate(net, prompts, new_tokens)
                gen_s.append(dt)
                got, dt = run_engine(core, prompts, new_tokens, f"{name}-{r}")
                eng_s.append(dt)
            toks = len(prompts) * new_tokens
            assert all(len(o) == new_tokens for o in got + ref)
            g, e = toks / min(gen_s), toks / min(eng_s)
            rows[name] = {"generate_tok_s": g, "engine_tok_s": e, "ratio": e / g,
                          "match": sum(a == b for a, b in zip(got, ref, strict=True)),
                          "seqs": len(prompts), "prompt_tokens": sum(map(len, prompts))}
    finally:
        core.stop()
    res = {"model": model, "new_tokens": new_tokens, "threads": threads, "cases": rows,
           "attention": core.attention,
           "ratio_mixed": rows[f"mixed x{batch}"]["ratio"],
           "ratio_single": rows["batch 1"]["ratio"]}
    res["pass"] = res["ratio_mixed"] >= GOAL_MIXED and res["ratio_single"] >= GOAL_SINGLE
    if verbose:
        print(f"{model}, {new_tokens} new tokens, {threads} thread(s), prompts "
              f"{min_len}..{max_len} tokens, best of {repeats}, engine attention: "
              f"{core.attention}")
        print(f"{'case':>12} {'prompt tok':>10} {'generate tok/s':>15} {'engine tok/s':>13} "
              f"{'ratio':>6} {'greedy equal':>13}")
        for name, r in rows.items():
            print(f"{name:>12} {r['prompt_tokens']:>10} {r['generate_tok_s']:>15.1f} "
                  f"{r['engine_tok_s']:>13.1f} {r['ratio']:>6.2f} "
                  f"{r['match']:>6}/{r['seqs']:<6}")
        print(f"goal: mixed >= {GOAL_MIXED}x, batch 1 >= {GOAL_SINGLE}x: "
              f"{'PASS' if res['pass'] else 'MISS'}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-moe", help="registry name (tiny-moe, tiny-dense, "
                    "tiny-qwen3.5, ...)")
    ap.add_argument("--batch", type=int, default=16, help="prompts in the mixed-length batch")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-len", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default="", help="comma-separated: several models in one run")
    a = ap.parse_args()
    for model in (a.models.split(",") if a.models else [a.model]):
        r = measure(model, a.batch, a.new_tokens, a.threads, a.repeats, a.min_len, a.max_len,
                    a.seed)
        emit(f"embedded engine / transformers.generate, output tok/s ({model}, mixed "
             f"x{a.batch})", r["ratio_mixed"], GOAL_MIXED)
        emit(f"embedded engine / transformers.generate, output tok/s ({model}, batch 1)",
             r["ratio_single"], GOAL_SINGLE)


if __name__ == "__main__":
    main()
