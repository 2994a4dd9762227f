"""The main-job command end to end: 2 gloo ranks, real Megatron, metrics, PNG, checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys


def test_lm_train_command(tmp_path):
    out_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "megatron_rl.cli", "lm-train", "tiny-moe-cpu",
           "train.steps=4", f"train.output_dir={out_dir}", f"checkpoint.dir={ckpt}",
           "checkpoint.save_every=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "on 2 rank(s)" in proc.stdout and "loss 6." in proc.stdout
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["loss"] < rows[0]["loss"]
    png = (out_dir / "lm_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (ckpt / "latest").read_text() == "step_000004"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000002", "step_000004"]
    assert not list(ckpt.glob(".tmp-*"))


def test_lm_train_under_torchrun(tmp_path):
    """The same command as one rank per process when torchrun starts it (PP2 here)."""
    import shutil
    from pathlib import Path

    from megatron_rl.distributed.process_groups import free_port

    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    out_dir = tmp_path / "run"
    cmd = [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()),
           "-m", "megatron_rl.cli", "lm-train", "tiny-moe-cpu", "parallel.ep=1", "parallel.pp=2",
           "train.steps=2", f"train.output_dir={out_dir}", "checkpoint.dir=null"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # written once, by rank 0
    assert abs(rows[0]["loss"] - 6.25) < 0.1


def test_rl_train_under_torchrun(tmp_path):
    """`megatron-rl train` as torchrun starts it: rank 0 drives (engine, scheduler, judge) and
    both ranks keep a TrainerWorker (EP2 across the two processes); rank 1 follows rank 0's
    jobs and exits 0 when the run ends."""
    import shutil
    from pathlib import Path

    from megatron_rl.distributed.process_groups import free_port

    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    out_dir = tmp_path / "run"
    cmd = [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()),
           "-m", "megatron_rl.cli", "train", "tiny-moe-rl-sanity-cpu", "train.steps=2",
           "rl.eval_every=0", f"train.output_dir={out_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "on 2 trainer rank(s), 2 steps" in proc.stdout
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # one driver
    for r in rows:
        assert r["batch/sequences"] == 16 and r["num_tokens"] > 0 and r["grad_norm"] > 0
        assert r["sync/mb"] > 0  # both ranks' expert shards reached the engine
