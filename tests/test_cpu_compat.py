"""Each CPU shim fixes a failure that still happens without it (checked in a clean process)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from megatron_rl.models import cpu_compat

PROBE = """
import json, torch
from megatron_rl.models import cpu_compat
print(json.dumps({s.name: bool(s.probe()) for s in cpu_compat.SHIMS}))
"""


def test_every_shim_is_still_needed():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    needed = json.loads(out)
    assert set(needed) == {s.name for s in cpu_compat.SHIMS}
    stale = [name for name, still in needed.items() if not still]
    assert not stale, f"upstream fixed these; delete their shims: {stale}"


def test_apply_is_idempotent_and_cpu_only():
    script = ("from megatron_rl.models import cpu_compat as c; a = list(c.apply()); "
              "b = list(c.apply()); print(a == b, len(a))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", str(len(cpu_compat.SHIMS))] or torch.cuda.is_available()
    assert cpu_compat.needs_shims() == (not torch.cuda.is_available())
