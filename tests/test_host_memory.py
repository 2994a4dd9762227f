"""Large freed blocks are reused, not unmapped and faulted in again (checked in fresh
processes: the setting is per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# the chunked log-prob pass at 512 tokens x 34k vocabulary: ~70 MB temporaries, above glibc's
# largest mmap threshold (32 MB)
PROBE = """
import json, resource, sys, torch
from megatron_rl.utils.host_memory import reuse_freed_memory
applied = reuse_freed_memory() if sys.argv[1] == "reuse" else False
from megatron_rl.models.logprobs import _LinearLogprobs
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
h = torch.randn(512, 64, generator=g).requires_grad_()
w = (torch.randn(34048, 64, generator=g) * 0.05).requires_grad_()
y = torch.randint(0, 34048, (512,), generator=g)
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    logp, ent = _LinearLogprobs.apply(h, w, y, 0, 34048, 1.0, None, 1)
    (logp.sum() + 0.01 * ent.sum()).backward()
    h.grad = w.grad = None
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _probe(mode: str, env: dict[str, str] | None = None, code: str = PROBE) -> dict:
    """`code` in a fresh process; its last line's JSON. Without the huge-page switch a tuned
    process (this one may be) hands its children."""
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                         check=True, env={**clean, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_temporaries_reuse_freed_memory_instead_of_faulting_it_in_again():
    default, reused = _probe("default"), _probe("reuse")
    print(f"\npage faults per pass: glibc default {default['faults']}, "
          f"freed memory reused {reused['faults']}")
    logits_pages = 512 * 34048 * 4 / os.sysconf("SC_PAGE_SIZE")
    assert reused["applied"] is True
    # by default every pass maps its [tokens, vocab] temporaries anew: the logits and their
    # gradient (33-46k faults a pass on an AMX machine, ~2x logits_pages; more than one
    # temporary's pages on every machine so far)
    assert min(default["faults"][1:]) > logits_pages
    # reused: once the heap holds them, a pass faults (almost) nothing in
    assert min(reused["faults"][1:]) < 0.05 * logits_pages


def test_a_users_own_glibc_tuning_wins():
    assert _probe("reuse", {"MALLOC_MMAP_MAX_": "65536"})["applied"] is False


HUGE = """
import json, sys, torch
from megatron_rl.utils.host_memory import tune_host_memory
applied = tune_host_memory() if sys.argv[1] == "tune" else {}
x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MB, every page touched
kb = [int(line.split()[1]) for line in open("/proc/self/smaps_rollup")
      if line.startswith("AnonHugePages:")][0]
print(json.dumps({"applied": applied, "huge_kb": kb}))
"""


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read()
    except OSError:
        return "[never]"


@pytest.mark.skipif("[madvise]" not in _thp_mode(),
                    reason="huge pages on request need the kernel's THP mode `madvise`")
def test_large_tensors_land_on_huge_pages_and_a_users_switch_wins():
    """With the kernel granting huge pages on request, a process that tuned its memory holds
    a large tensor on them; untuned, or with the user's own switch off, on small pages."""
    tuned, plain = _probe("tune", code=HUGE), _probe("plain", code=HUGE)
    assert tuned["applied"] == {"reuse_freed_memory": True, "huge_pages": True}
    assert tuned["huge_kb"] >= 32 << 10  # at least half of the 64 MB tensor
    assert plain["huge_kb"] == 0
    off = _probe("tune", {"THP_MEM_ALLOC_ENABLE": "0"}, HUGE)
    assert off["applied"]["huge_pages"] is False and off["huge_kb"] == 0
