"""Conversion throughput and memory: HF → torch_dist → HF on a generated MoE, same run.

Prints checkpoint size, wall time, MB/s and peak RSS of each direction, next to the RSS of a
process that only imports the same libraries (the floor), so "streaming" can be judged as
peak RSS minus floor vs checkpoint size.

    python benchmarks/conversion.py [--layers 12 --hidden 768 --experts 16 --shard-mb 256]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from generated_moe import add_size_args, spec_yaml
from results import emit

FLOOR = ("import resource, torch, transformers, megatron_rl.checkpoint.convert; "
         "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")


def _make_hf(spec_path: Path, out: Path) -> None:
    code = f"""
import torch, transformers
from megatron_rl.models.registry import get_model_spec
torch.manual_seed(0)
spec = get_model_spec({str(spec_path)!r})
m = transformers.AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
m.save_pretrained({str(out)!r}, max_shard_size="500MB")
"""
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def _run(cmd: list[str]) -> tuple[float, str]:
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    return time.time() - t0, proc.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(p, layers=12, hidden=768, experts=16)
    p.add_argument("--shard-mb", type=int, default=256)
    a = p.parse_args()
    cli = [sys.executable, "-m", "megatron_rl.cli", "convert"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spec = tmp / "bench-moe.yaml"
        spec.write_text(spec_yaml(a))
        hf, mcore, back = tmp / "hf", tmp / "mcore", tmp / "back"
        _make_hf(spec, hf)
        size_mb = sum(f.stat().st_size for f in hf.glob("*.safetensors")) / 1e6
        layer_mb = size_mb / a.layers
        floor = float(subprocess.run([sys.executable, "-c", FLOOR], capture_output=True,
                                     text=True, check=True).stdout.split()[-1])
        rows = []
        secs, out = _run([*cli, "hf-to-megatron", "--hf", str(hf), "--out", str(mcore),
                          "--model", str(spec)])
        rss = float(re.search(r"peak RSS (\d+) MB", out).group(1))
        rows.append(("HF → torch_dist (1 process)", secs, rss))
        secs, out = _run([*cli, "megatron-to-hf", "--ckpt", str(mcore), "--out", str(back),
                          "--model", str(spec), "--max-shard-gb", str(a.shard_mb / 1024)])
        rss = float(re.search(r"peak RSS (\d+) MB", out).group(1))
        rows.append(("torch_dist → HF (1 process)", secs, rss))
    print(f"model: {a.layers} layers, hidden {a.hidden}, {a.experts} experts; "
          f"checkpoint {size_mb:.0f} MB fp32 (~{layer_mb:.0f} MB per layer); "
          f"output shards {a.shard_mb} MB; import-only floor RSS {floor:.0f} MB")
    print(f"{'direction':34s} {'seconds':>8s} {'MB/s':>7s} {'peak RSS':>9s} "
          f"{'RSS - floor':>12s} {'÷ ckpt':>7s}")
    for name, secs, rss in rows:
        print(f"{name:34s} {secs:8.1f} {size_mb / secs:7.1f} {rss:7.0f}MB {rss - floor:10.0f}MB "
              f"{(rss - floor) / size_mb:7.2f}")
    for name, secs, rss in rows:
        short = name.split(" (")[0]
        emit(f"conversion {short}, MB/s", size_mb / secs, 100.0, unit="MB/s")
        emit(f"conversion {short}, peak RSS above the floor / checkpoint size",
             (rss - floor) / size_mb, 0.5, better="lower")
    print(json.dumps({"size_mb": size_mb, "floor_mb": floor,
                      "rows": [{"direction": n, "seconds": s, "peak_rss_mb": r}
                               for n, s, r in rows]}))


if __name__ == "__main__":
    main()
