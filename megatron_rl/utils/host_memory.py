"""Host allocator settings for CPU training and serving processes.

glibc serves every allocation above its mmap threshold (32 MB at most) with a fresh `mmap` and
unmaps it on free, so each large temporary (a chunk's [tokens, vocab] logits, activations)
faults all its pages in again: at the quickstart's pre-training shape one log-prob pass faulted
~205k pages, 0.33 s of a 1.06 s pass. With mmap and heap trimming off the freed
temporaries stay in the heap and the next pass reuses them: 0 faults, 0.70-0.78 s
(`benchmarks/host_allocator.py`, `tests/test_host_memory.py`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
# never trim the heap (glibc's documented -1). With a 2 GiB threshold, alternating a
# Megatron and a transformers step at the quickstart's 34k-id shape (the benchmark's
# pattern) faulted ~272k pages (~1 GB) back in every step, on both sides; with -1, none
KEEP_FREED_BYTES = -1
# a user's own glibc tuning wins
GLIBC_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                   "MALLOC_TOP_PAD_")


@functools.cache
def reuse_freed_memory(*, only_without_cuda: bool = True) -> bool:
    """Keep large freed blocks for reuse instead of unmapping them (glibc on Linux; once per
    process). Off where CUDA is present (`only_without_cuda`): GPU hosts stage far larger
    buffers (offloaded weights), whose memory should go back to the system. True if applied."""
    if not sys.platform.startswith("linux") or any(v in os.environ for v in GLIBC_VARIABLES):
        return False
    if only_without_cuda:
        import torch

        if torch.cuda.is_available():
            return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return (libc.mallopt(M_MMAP_MAX, 0) == 1
                and libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(KEEP_FREED_BYTES)) == 1)
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
