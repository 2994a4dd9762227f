"""Fixed micro-batches vs token-budget micro-batches vs sequence packing (vs shared prefixes),
one run, same batch.

A global batch of sequences with heavy-tailed lengths (log-normal: median `--median` tokens,
sigma `--sigma`, clipped to [16, --seq]), like agentic rollouts where a few trajectories run
long. Each mode trains the same model from the same seed on it (lm loss over every token) and
reports the median train-step time (the modes' steps alternate), the micro-batches it ran and
the share of the model's input positions that were padding. The fixed mode pads every row to
`--seq` in micro-batches of `--micro` rows; the others use a budget of micro × seq tokens per
micro-batch.

`--openings N`: every sequence first opens with one of `--roles` common openings of N untrained
tokens (an agent role's system prompt) and trains only after it; a fourth mode packs with
`train.share_prefixes` (each opening once per group), and its speed-up over packing is the
headline (`BENCHMARK-RESULT`).

    python benchmarks/microbatching.py [--model tiny-moe --rows 32 --seq 1024 --median 96]
    python benchmarks/microbatching.py --openings 176 --roles 2 --median 120 --seq 512
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from results import emit


def lengths(n: int, median: int, sigma: float, longest: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(longest, max(16, round(rng.lognormvariate(0, sigma) * median)))
            for _ in range(n)]


def make_batch(lens: list[int], seq: int, vocab: int, opening: int = 0, roles: int = 1):
    """Rows of random tokens; with `opening`, row i opens with role i % roles's common
    `opening` tokens and trains only after them (else every target)."""
    from megatron_rl.records.batch import TokenBatch

    g = torch.Generator().manual_seed(0)
    tokens = torch.zeros(len(lens), seq + 1, dtype=torch.long)
    mask = torch.zeros(len(lens), seq + 1)
    prompts = torch.randint(1, vocab, (roles, opening), generator=g)
    for i, n in enumerate(lens):
        tokens[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        tokens[i, :opening] = prompts[i % roles]
        mask[i, opening + 1:n] = 1.0
    return TokenBatch.from_sequences(tokens, mask)


def prepare_mode(name: str, overrides: list[str], batch) -> dict:
    """One mode's actor and its layout of `batch`; `step()` trains one step."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.trainer.actor import MegatronActor
    from megatron_rl.trainer.losses import lm_loss
    from megatron_rl.trainer.microbatching import MicroBatch, effective_lengths

    actor = MegatronActor(load_config(None, overrides))
    micro = actor._micro_batches(batch)
    positions = sum(mb.input_ids.numel() for mb in micro)
    tokens = int(effective_lengths(batch).sum())  # the sequences' own, whatever the layout
    if all(isinstance(mb, MicroBatch) for mb in micro):
        real = sum(int(mb.valid.sum()) for mb in micro)  # fewer with shared openings
    else:  # fixed rows: everything past a row's last trained token is padding
        real = tokens
    return {"mode": name, "micro": len(micro), "positions": positions,
            "padding": 1 - real / positions, "tokens": tokens,
            "step": lambda: actor.train_step(batch, lm_loss)["loss"]}


def run_modes(modes: list[dict], warmup: int, steps: int) -> None:
    """Each mode's median step time and first loss, the modes' steps alternating (each round
    starting one mode later), so that load from elsewhere hits all alike: run one after
    another, the shared-openings ratio read 1.29-1.68 between runs."""
    for m in modes:
        m["loss"] = m["step"]()
        for _ in range(warmup - 1):
            m["step"]()
        m["times"] = []
    for r in range(steps):
        for m in modes[r % len(modes):] + modes[:r % len(modes)]:
            t0 = time.perf_counter()
            m["step"]()
            m["times"].append(time.perf_counter() - t0)
    for m in modes:
        m["step_s"] = statistics.median(m["times"])
        m["tokens_per_s"] = m["tokens"] / m["step_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-moe")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--seq", type=int, default=1024, help="model.seq_length (the longest row)")
    p.add_argument("--micro", type=int, default=2, help="rows per fixed micro-batch")
    p.add_argument("--median", type=int, default=96)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="rounds of one step per mode")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--openings", type=int, default=0,
                   help="untrained tokens every sequence opens with (0: none)")
    p.add_argument("--roles", type=int, default=2, help="distinct openings")
    a = p.parse_args()

    from megatron_rl.utils.logs import quiet_libraries

    quiet_libraries()
    from megatron_rl.distributed.process_groups import init_distributed
    from megatron_rl.models.registry import get_model_spec

    torch.set_num_threads(a.threads)
    init_distributed("gloo")
    lens = [min(a.seq, a.openings + n)
            for n in lengths(a.rows, a.median, a.sigma, a.seq - a.openings, seed=0)]
    batch = make_batch(lens, a.seq, get_model_spec(a.model).vocab_size, a.openings, a.roles)
    budget = a.micro * a.seq
    base = [f"model.name={a.model}", f"model.seq_length={a.seq}",
            f"train.global_batch_size={a.rows}", f"train.micro_batch_size={a.micro}",
            "optim.lr=1e-4", "train.seed=1"]
    modes = [("fixed", []),
             ("token-budget", [f"train.max_tokens_per_microbatch={budget}"]),
             ("packed", [f"train.max_tokens_per_microbatch={budget}",
                         "train.pack_sequences=true"])]
    if a.openings:
        modes.append(("shared", [*modes[-1][1], "train.share_prefixes=true"]))
    srt = sorted(lens)
    print(f"{a.model}, {a.rows} sequences, log-normal lengths (median {a.median}, sigma "
          f"{a.sigma}, clipped to [16, {a.seq}]): min {srt[0]}, p50 {srt[len(srt) // 2]}, "
          f"p90 {srt[int(len(srt) * 0.9)]}, max {srt[-1]}, total {sum(lens)} tokens; "
          f"fixed: {a.micro} rows x {a.seq}; budget: {budget} tokens per micro-batch; "
          f"{a.threads} threads, median of {a.steps} steps"
          + (f"; each opens with one of {a.roles} common {a.openings}-token openings"
             if a.openings else ""))
    rows = [prepare_mode(name, base + ov, batch) for name, ov in modes]
    run_modes(rows, max(a.warmup, 1), a.steps)
    print(f"{'mode':>13s} {'micro-batches':>13s} {'positions':>9s} {'padding':>8s} "
          f"{'step s':>7s} {'seq tok/s':>10s} {'loss':>8s}")
    for r in rows:
        print(f"{r['mode']:>13s} {r['micro']:13d} {r['positions']:9d} {r['padding']:8.1%} "
              f"{r['step_s']:7.2f} {r['tokens_per_s']:10.0f} {r['loss']:8.4f}")
    fixed = rows[0]["step_s"]
    print("speed-up vs fixed: " + ", ".join(f"{r['mode']} {fixed / r['step_s']:.2f}x"
                                            for r in rows[1:]))
    if a.openings:
        packed, shared = rows[2], rows[3]
        print(f"shared prefixes vs packing: {packed['step_s'] / shared['step_s']:.2f}x the "
              f"speed, {shared['positions']} vs {packed['positions']} positions, loss "
              f"{shared['loss']:.6f} vs {packed['loss']:.6f}")
        emit(f"train step, shared {a.openings}-token openings vs packing",
             packed["step_s"] / shared["step_s"], 1.3,
             note=f"{a.model}, {a.rows} sequences, {a.roles} openings")


if __name__ == "__main__":
    main()
