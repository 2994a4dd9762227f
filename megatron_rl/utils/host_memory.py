"""Host memory settings for CPU training and serving processes (`tune_host_memory`).

- **Freed memory reused.** glibc serves every allocation above its mmap threshold (32 MB at
  most) with a fresh `mmap` and unmaps it on free, so each large temporary (a chunk's [tokens,
  vocab] logits, activations) faults all its pages in again: at the quickstart's pre-training
  shape one log-prob pass faulted ~205k pages, 0.33 s of a 1.06 s pass. With mmap and heap
  trimming off the freed temporaries stay in the heap and the next pass reuses them: 0
  faults, 0.70-0.78 s.
- **Large tensors on huge pages.** With `THP_MEM_ALLOC_ENABLE` (read at torch's first CPU
  allocation) torch page-aligns CPU tensors of 2 MB and more and asks the kernel for
  transparent huge pages there (`madvise`); a host whose THP setting is `madvise` (the common
  default) then backs them with 2 MB pages: far fewer page faults and TLB misses when
  [tokens, vocab] temporaries are streamed. The same pass on session 45's EPYC, against
  glibc's default: 0.86 reused, 0.83-0.86 reused with huge pages (huge pages alone: 0.92 ->
  0.70 s in one probe).

`benchmarks/host_allocator.py`, `tests/test_host_memory.py`.
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
TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"  # c10's switch; a user's own value wins too
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def tune_host_memory(*, reuse: bool = True, huge_pages: bool = True) -> dict[str, bool]:
    """This module's settings, once per process, before large tensors are made; which ones
    took effect. Work that streams through memory once wants neither: a checkpoint
    conversion's peak RSS was 0.33 of the checkpoint with glibc's defaults, 0.41-0.51 with
    freed memory kept (at 1.3x the speed) and up to 0.50 with huge pages too."""
    return {"reuse_freed_memory": reuse and reuse_freed_memory(),
            "huge_pages": huge_pages and large_tensors_on_huge_pages()}


@functools.cache
def large_tensors_on_huge_pages(*, only_without_cuda: bool = True) -> bool:
    """torch's CPU tensors of 2 MB and more on transparent huge pages, where the kernel grants
    them on request (THP `madvise` or `always`) and the user set nothing. torch reads its
    switch once, at its first CPU allocation: call this before any tensor is made (the entry
    points do, first thing). True if the switch is on."""
    if not sys.platform.startswith("linux") or TORCH_HUGE_PAGES in os.environ:
        return os.environ.get(TORCH_HUGE_PAGES) == "1"
    try:
        with open(THP_MODE) as f:
            if "[never]" in f.read():
                return False
    except OSError:
        return False
    if only_without_cuda:
        import torch

        if torch.cuda.is_available():
            return False
    os.environ[TORCH_HUGE_PAGES] = "1"
    return True


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
