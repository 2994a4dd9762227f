"""Large temporaries on a CPU: glibc's default allocator against freed memory kept for reuse
(`megatron_rl.utils.host_memory.reuse_freed_memory`), side by side in one process.

The workload is the chunked log-prob pass (forward and backward) at the quickstart's
pre-training shape: each rank's 1,536 tokens over a 34,048-token vocabulary, hidden 128, whose
[tokens, vocab] temporaries are ~200 MB each. The two settings alternate per repeat (mallopt
is switched back and forth), median of `--repeats` each.

    python benchmarks/host_allocator.py [--tokens 1536 --vocab 34048 --hidden 128]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
from results import emit

from megatron_rl.models.logprobs import _LinearLogprobs
from megatron_rl.utils import host_memory

GLIBC_DEFAULT_MMAP_MAX, GLIBC_DEFAULT_TRIM = 65536, 128 * 1024


def _mallopt(mmap_max: int, trim: int) -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(host_memory.M_MMAP_MAX, mmap_max)
    libc.mallopt(host_memory.M_TRIM_THRESHOLD, ctypes.c_int(trim))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=34048)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(a.tokens, a.hidden, generator=g).requires_grad_()
    w = (torch.randn(a.vocab, a.hidden, generator=g) * 0.05).requires_grad_()
    y = torch.randint(0, a.vocab, (a.tokens,), generator=g)

    def step() -> float:
        t0 = time.perf_counter()
        logp, ent = _LinearLogprobs.apply(h, w, y, 0, a.vocab, 1.0, None, 1)
        (logp.sum() + 0.01 * ent.sum()).backward()
        h.grad = w.grad = None
        return time.perf_counter() - t0

    settings = {"glibc default": (GLIBC_DEFAULT_MMAP_MAX, GLIBC_DEFAULT_TRIM),
                "freed memory reused": (0, host_memory.KEEP_FREED_BYTES)}
    times: dict[str, list[float]] = {name: [] for name in settings}
    for opts in settings.values():  # warm-up
        _mallopt(*opts)
        step()
    for _ in range(a.repeats):
        for name, opts in settings.items():
            _mallopt(*opts)
            times[name].append(step())
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"log-prob pass, {a.tokens} tokens x {a.vocab} vocab, hidden {a.hidden}, "
          f"{a.threads} thread(s), median of {a.repeats}")
    for name, t in med.items():
        print(f"{name:22s} {t * 1e3:8.0f} ms")
    ratio = med["freed memory reused"] / med["glibc default"]
    print(f"ratio reused / default = {ratio:.2f}")
    emit("log-prob pass time, freed memory reused / glibc default (34k vocab)", ratio, 0.9,
         better="lower")


if __name__ == "__main__":
    main()
