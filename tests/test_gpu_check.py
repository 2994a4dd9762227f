"""The GPU check's CPU side: tests/gpu/run_all.sh says one line and exits 0 without a GPU, and
benchmarks/mfu.py runs at a tiny size on CPU (so it cannot rot) with FLOPs that add up."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.models.registry import get_model_spec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import mfu  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available() or shutil.which("nvidia-smi") is not None,
                    reason="a GPU machine runs the real check")
def test_run_all_without_a_gpu_is_one_line_and_success(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "tests/gpu/run_all.sh")], capture_output=True,
                       text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert r.returncode == 0 and r.stdout.strip().count("\n") == 0
    assert "no CUDA GPU" in r.stdout
    r = subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh")], capture_output=True,
                       text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "no CUDA GPU" in r.stdout


def test_peaks_by_device_name():
    assert mfu.peak_flops("NVIDIA H200") == 989e12
    assert mfu.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert mfu.peak_flops("NVIDIA H20") == 148e12
    assert mfu.peak_flops("Some GPU") is None


def test_flops_per_token_of_qwen3_30b_a3b_is_six_times_its_active_params():
    spec = get_model_spec("qwen3-30b-a3b")
    seq = 4096
    attention_scores = 3 * spec.num_layers * 2 * spec.num_attention_heads * spec.head_dim * seq
    dense = mfu.flops_per_token(spec, seq) - attention_scores
    active = dense / 6  # ~3.3B active parameters incl. the output layer ("A3B")
    assert 3.0e9 < active < 3.4e9, active
    # a slice scales with its layers (plus the fixed logits)
    two = dataclasses.replace(spec, num_layers=2)
    logits = 3 * 2 * spec.hidden_size * spec.vocab_size
    per_layer = (mfu.flops_per_token(spec, seq) - logits) / spec.num_layers
    assert mfu.flops_per_token(two, seq) == pytest.approx(logits + 2 * per_layer)


def test_mfu_benchmark_runs_tiny_on_cpu(tmp_path):
    out = tmp_path / "mfu.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/mfu.py"), "--tiny", "--json",
                        str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [row["model"] for row in rows] == ["tiny-moe", "tiny-qwen3.5"]
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["fwd_bwd_s"] > 0
        assert row["flops_per_token"] > 0 and row["mfu"] is None and row["device"] == "cpu"
        assert all(x == x for x in row["losses"])
    assert rows[1]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert "[mfu] tiny-moe x2 layers" in r.stdout
