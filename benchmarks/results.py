"""The headline number of a benchmark as one machine-readable line, for `run_all.py`.

Each benchmark prints its own tables for people; `emit` adds one line per goal it measures:

    BENCHMARK-RESULT {"metric": "...", "value": 0.93, "goal": 0.8, "better": "higher", ...}
"""

from __future__ import annotations

import json

PREFIX = "BENCHMARK-RESULT "


def emit(metric: str, value: float, goal: float, *, better: str = "higher",
         unit: str = "x", note: str = "") -> None:
    """`better`: "higher" (a ratio or a rate that should reach `goal`) or "lower" (a time or a
    share that should stay under it)."""
    if better not in ("higher", "lower"):
        raise ValueError(f"better={better!r}: 'higher' or 'lower'")
    met = value >= goal if better == "higher" else value <= goal
    print(PREFIX + json.dumps({"metric": metric, "value": round(float(value), 4), "goal": goal,
                               "better": better, "unit": unit, "met": bool(met),
                               "note": note}), flush=True)


def parse(output: str) -> list[dict]:
    return [json.loads(line[len(PREFIX):]) for line in output.splitlines()
            if line.startswith(PREFIX)]
