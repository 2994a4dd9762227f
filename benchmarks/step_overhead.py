"""Step overhead of the RL loop on the tiny run: the share of a step's wall time spent neither
in engine generation (the embedded engine's prefill/decode steps) nor in Megatron's
forward/backward schedules (log-prob passes and the training pass). Goal: <= 0.05.

What the rest is: tool calls (local search), judging, agent parsing and HTTP, building the
batch, shipping it to the trainer ranks, the optimizer step, weight sync and logging. Periodic
work is off (held-out eval, checkpoints): it is not part of a step.

    .venv/bin/python benchmarks/step_overhead.py [--steps 6] [--nproc 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from results import emit

from megatron_rl.config.loader import load_config
from megatron_rl.distributed.worker_pool import WorkerPool
from megatron_rl.train import train
from megatron_rl.utils.logs import quiet_libraries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="extra config overrides")
    args = ap.parse_args()
    quiet_libraries()
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("tiny-moe-rl-cpu", [
            f"train.steps={args.steps}", f"train.output_dir={out}", "checkpoint.dir=null",
            "rl.eval_every=0",
            *([] if args.nproc == 2 else ["parallel.ep=1"]), *args.overrides])
        with WorkerPool(args.nproc) as pool:
            rows = train(cfg, pool)
    rows = rows[1:]  # the first step pays one-off costs (imports, first allocations)
    print(f"\n{len(rows)} steps after warm-up, tiny-moe on {args.nproc} trainer rank(s), "
          f"{cfg.rl.sampling.groups_per_step} groups x "
          f"{cfg.rl.sampling.samples_per_prompt} samples, "
          f"{cfg.rl.agent} agent, max_turns {cfg.rl.max_turns}")
    print(f"{'step s':>8} {'generate':>9} {'fwd/bwd':>8} {'other':>8} {'overhead':>9}")
    shares = []
    for r in rows:
        step, gen, fb = r["time/step"], r["time/generate"], r.get("time/forward_backward", 0.0)
        other = step - gen - fb
        shares.append(other / step)
        print(f"{step:8.2f} {gen:9.2f} {fb:8.2f} {other:8.2f} {other / step:9.3f}")
    parts = ("time/judge", "time/sync", "time/train", "time/rollout")
    print("mean seconds: " + ", ".join(f"{k}={statistics.mean(r[k] for r in rows):.3f}"
                                       for k in parts))
    ratio = statistics.mean(shares)
    print(f"\nstep overhead (not generation, not forward/backward) / step time: {ratio:.3f} "
          f"(goal <= 0.05: {'PASS' if ratio <= 0.05 else 'MISS'})")
    emit("framework overhead / RL step time", ratio, 0.05, better="lower")


if __name__ == "__main__":
    main()
