"""Every benchmark at a quick size, one after another, and one table of its headline ratios.

Each benchmark runs as its own process (they set torch threads, start engines and gloo groups)
and prints a `BENCHMARK-RESULT` line per goal (benchmarks/results.py); this collects them:

    metric | measured | goal | met?

    python benchmarks/run_all.py [--out runs/benchmarks] [--only weight_sync,search_latency]
                                 [--quickstart-run runs/quickstart]

Writes `<out>/results.md` (the table), `<out>/results.json` and each benchmark's full output
(`<out>/<name>.log`). Ratios are measured side by side within one process each, so they hold
on a loaded machine better than absolute times do; still, run it on idle cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from results import parse

HERE = Path(__file__).resolve().parent
# name → quick arguments (each runs in a minute or two on 2 cores)
BENCHMARKS: dict[str, list[str]] = {
    # medians of 9 steady syncs a transport (of 3, the tp2 look-ahead moved 0.85-0.91)
    "weight_sync": ["--transports", "one-copy,one-copy-http,one-copy-held,tensor",
                    "--bucket-mb", "64",
                    "--two-ranks", "ep2,pp2,tp2", "--repeats", "9"],
    "megatron_cpu_step": [],
    # best of 9 (of 5, the hybrid's mixed row read 1.17-1.48 on session 44's host, whose speed
    # moved +-25 % between half-second runs; of 9, 1.51-1.72 in six runs)
    "engine_vs_generate": ["--models", "tiny-moe,tiny-qwen3.5", "--repeats", "9"],
    # best of 5 (of 3, the IterSynth row read 1.08-1.28 on session 44's host)
    "prefix_cache": ["--repeats", "5"],
    "microbatching": ["--openings", "176", "--roles", "2", "--median", "120", "--seq", "512",
                      "--rows", "48", "--micro", "4"],
    "partial_rollout": [],
    "step_overhead": ["--steps", "8"],
    "conversion": [],
    "search_latency": ["--sizes", "10000,100000,1000000", "--queries", "1000"],
    "degeneracy": [],
    "host_allocator": [],
    "output_layer": ["--repeats", "4"],  # best of 4: at 16 episodes 2 moved 0.95-1.05
}


def run_one(name: str, args: list[str], out: Path, timeout_s: float) -> tuple[list[dict], float]:
    log = out / f"{name}.log"
    t0 = time.perf_counter()
    print(f"[run_all] {name} {' '.join(args)} ...", flush=True)
    try:
        proc = subprocess.run([sys.executable, str(HERE / f"{name}.py"), *args], cwd=HERE.parent,
                              capture_output=True, text=True, timeout=timeout_s)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout_s:.0f} s", -1
    secs = time.perf_counter() - t0
    log.write_text(text if isinstance(text, str) else text.decode(errors="replace"))
    results = parse(log.read_text())
    if rc != 0 or not results:
        results.append({"metric": f"{name}: failed (exit {rc}; see {log})", "value": float("nan"),
                        "goal": float("nan"), "better": "higher", "unit": "", "met": False})
    print(f"[run_all] {name}: {len(results)} result(s) in {secs:.0f} s", flush=True)
    return results, secs


def _shown(r: dict) -> str:
    """3 significant digits, or as many more as it takes not to round onto the goal's side
    (0.7996 against >= 0.8 reads 0.7996, not 0.8)."""
    for digits in (3, 4, 5, 6):
        text = f"{r['value']:.{digits}g}"
        if float(text) != r["goal"] or r["value"] == r["goal"]:
            return text
    return text


def table(rows: list[dict]) -> str:
    lines = ["| metric | measured | goal | met? |", "|---|---|---|---|"]
    for r in rows:
        sign = ">=" if r["better"] == "higher" else "<="
        value = "-" if r["value"] != r["value"] else f"{_shown(r)} {r['unit']}".strip()
        goal = "-" if r["goal"] != r["goal"] else f"{sign} {r['goal']:g} {r['unit']}".strip()
        lines.append(f"| {r['metric']} | {value} | {goal} | {'yes' if r['met'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/benchmarks")
    p.add_argument("--only", default="", help="comma-separated benchmark names")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per benchmark")
    p.add_argument("--quickstart-run", type=Path, default=Path("runs/quickstart"),
                   help="a finished quickstart: step_overhead also reports its RL stage's "
                        "overhead share (skipped when it has no rl/metrics.jsonl)")
    a = p.parse_args()
    rl_metrics = a.quickstart_run / "rl" / "metrics.jsonl"
    extra = {"step_overhead": ["--from-metrics", str(rl_metrics)]} if rl_metrics.exists() else {}
    names = [n for n in a.only.split(",") if n] or list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHMARKS)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, times = [], {}
    for name in names:
        got, times[name] = run_one(name, BENCHMARKS[name] + extra.get(name, []), out,
                                   a.timeout_s)
        rows += [{**r, "benchmark": name} for r in got]
    md = table(rows)
    (out / "results.md").write_text(md + "\n")
    (out / "results.json").write_text(json.dumps({"results": rows, "seconds": times}, indent=1))
    print("\n" + md)
    print(f"\n{sum(r['met'] for r in rows)} of {len(rows)} goals met; "
          f"{sum(times.values()) / 60:.1f} min; logs in {out}/")


if __name__ == "__main__":
    main()
