"""Metrics: one JSON line per step, a console line, and PNG curves people can look at."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Rank 0 writes; other ranks hold a logger that does nothing."""

    def __init__(self, output_dir: str | Path, enabled: bool = True, resume: bool = False):
        self.enabled = enabled
        self.dir = Path(output_dir)
        self.path = self.dir / "metrics.jsonl"
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not resume and self.path.exists():
                self.path.unlink()

    def log(self, step: int, metrics: dict[str, Any], console_keys: tuple[str, ...] = ()) -> None:
        if not self.enabled:
            return
        row = {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        keys = console_keys or tuple(k for k in metrics if k != "step")
        shown = " ".join(f"{k}={_fmt(metrics[k])}" for k in keys if k in metrics)
        print(f"step {step:5d} | {shown}", flush=True)

    def rows(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)

    def plot(self, keys: tuple[str, ...], filename: str = "curves.png") -> Path | None:
        return plot_metrics(self.rows(), keys, self.dir / filename) if self.enabled else None


def _fmt(v: Any) -> str:
    return f"{v:.5g}" if isinstance(v, float) else str(v)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_metrics(rows: list[dict[str, Any]], keys: tuple[str, ...], out: Path) -> Path:
    """One panel per metric against step; written atomically as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = tuple(k for k in keys if any(k in r for r in rows))
    cols = min(3, max(1, len(keys)))
    nrows = max(1, math.ceil(len(keys) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.2 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
    return out
