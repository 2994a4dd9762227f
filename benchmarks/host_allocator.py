"""Large temporaries on a CPU: glibc's default allocator and pages against megatron-rl's host
memory settings (`megatron_rl.utils.host_memory.tune_host_memory`: freed memory kept for reuse,
large tensors on transparent huge pages), and against reuse alone, side by side in one run.

The workload is the chunked log-prob pass (forward and backward) at the quickstart's
pre-training shape: each rank's 1,536 tokens over a 34,048-token vocabulary, hidden 128, whose
[tokens, vocab] temporaries are ~200 MB each. Each setting runs in fresh processes (a
process's heap remembers what it was given, so switching mallopt back and forth in one process
measures neither), the three alternating for `--rounds`; each process reports its median pass
after a warm-up one, and the row is the median of each round's ratio to the default.

    python benchmarks/host_allocator.py [--tokens 1536 --vocab 34048 --hidden 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
from results import emit

from megatron_rl.models.logprobs import _LinearLogprobs
from megatron_rl.utils import host_memory

SETTINGS = ("glibc default", "freed memory reused", "reused + huge pages")


def child(a: argparse.Namespace) -> None:
    """One process, one setting: its median log-prob pass, printed as the last line."""
    if a.child == SETTINGS[1]:
        assert host_memory.reuse_freed_memory()
    elif a.child == SETTINGS[2]:  # megatron-rl's processes
        assert all(host_memory.tune_host_memory().values()), "no huge pages on this host"
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(a.tokens, a.hidden, generator=g).requires_grad_()
    w = (torch.randn(a.vocab, a.hidden, generator=g) * 0.05).requires_grad_()
    y = torch.randint(0, a.vocab, (a.tokens,), generator=g)
    times = []
    for _ in range(1 + a.repeats):  # the first fills the heap
        t0 = time.perf_counter()
        logp, ent = _LinearLogprobs.apply(h, w, y, 0, a.vocab, 1.0, None, 1)
        (logp.sum() + 0.01 * ent.sum()).backward()
        h.grad = w.grad = None
        times.append(time.perf_counter() - t0)
    print(statistics.median(times[1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=34048)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="passes per process after warm-up")
    p.add_argument("--rounds", type=int, default=5, help="processes per setting, alternating")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)
    env = {k: v for k, v in os.environ.items()
           if k not in (*host_memory.GLIBC_VARIABLES, host_memory.TORCH_HUGE_PAGES)}
    med: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for r in range(a.rounds):
        turn = r % len(SETTINGS)  # each round starts one setting later
        for name in SETTINGS[turn:] + SETTINGS[:turn]:
            out = subprocess.run([sys.executable, __file__, "--child", name,
                                  *(f"--{k}={getattr(a, k)}" for k in
                                    ("tokens", "vocab", "hidden", "repeats", "threads"))],
                                 capture_output=True, text=True, check=True, env=env)
            med[name].append(float(out.stdout.strip().splitlines()[-1]))
    print(f"log-prob pass, {a.tokens} tokens x {a.vocab} vocab, hidden {a.hidden}, "
          f"{a.threads} thread(s); per setting {a.rounds} processes x {a.repeats} passes")
    for name, ts in med.items():
        print(f"{name:22s} " + " ".join(f"{t * 1e3:6.0f}" for t in ts) + " ms")
    # paired: each round's processes ran seconds apart, so a slow stretch of the host slows
    # every setting of that round (a process's passes moved 640-950 ms between rounds)
    reused, tuned = (statistics.median(t / d for t, d in zip(med[s], med[SETTINGS[0]],
                                                             strict=True))
                     for s in SETTINGS[1:])
    apart = statistics.median(med[SETTINGS[2]]) / statistics.median(med[SETTINGS[0]])
    print(f"ratio reused / default = {reused:.2f}; reused + huge pages / default = {tuned:.2f} "
          f"(medians of the rounds' ratios; the medians apart {apart:.2f})")
    emit("log-prob pass time, megatron-rl's host memory settings / glibc default (34k vocab)",
         tuned, 0.9, better="lower",
         note=f"freed memory reused alone {reused:.2f}; medians apart {apart:.2f}")


if __name__ == "__main__":
    main()
