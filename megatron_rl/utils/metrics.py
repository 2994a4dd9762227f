"""Metrics: one JSON line per step, a console line, PNG curves people can look at, and optional
sinks (TensorBoard, Weights & Biases) fed the same numeric rows."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

SINKS = ("tensorboard", "wandb")


class MetricsLogger:
    """Rank 0 writes; other ranks hold a logger that does nothing.

    `resume_from=step` keeps the rows of steps <= `step` (a run resumed from that checkpoint
    rewrites what came after it, e.g. after a kill); None starts a fresh file."""

    def __init__(self, output_dir: str | Path, enabled: bool = True,
                 resume_from: int | None = None, sinks: tuple[str, ...] = ()):
        self.enabled = enabled
        self.dir = Path(output_dir)
        self.path = self.dir / "metrics.jsonl"
        self.sinks = [_open_sink(name, self.dir) for name in sinks] if enabled else []
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            truncate_jsonl(self.path, resume_from)

    def log(self, step: int, metrics: dict[str, Any], console_keys: tuple[str, ...] = ()) -> None:
        if not self.enabled:
            return
        row = {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        numeric = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        for sink in self.sinks:
            sink(step, numeric)
        keys = console_keys or tuple(k for k in metrics if k != "step")
        shown = " ".join(f"{k}={_fmt(metrics[k])}" for k in keys if k in metrics)
        print(f"step {step:5d} | {shown}", flush=True)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def rows(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)

    def plot(self, keys: tuple[str, ...], filename: str = "curves.png") -> Path | None:
        return plot_metrics(self.rows(), keys, self.dir / filename) if self.enabled else None


def truncate_jsonl(path: Path, keep_until: int | None, key: str = "step") -> None:
    """Keep the rows with `key` <= keep_until (all gone when None), atomically."""
    if not path.exists():
        return
    rows = [] if keep_until is None else [
        line for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get(key, 0) <= keep_until]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in rows))
    tmp.replace(path)


class _TensorBoard:
    def __init__(self, folder: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("train.loggers has 'tensorboard' but the tensorboard package is "
                              "not installed: pip install 'megatron-rl[tracking]'") from e
        self.writer = SummaryWriter(str(folder / "tensorboard"))

    def __call__(self, step: int, row: dict[str, float]) -> None:
        for k, v in row.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    """Project and entity come from WANDB_PROJECT / WANDB_ENTITY, the key from WANDB_API_KEY
    (never from a config file); WANDB_MODE=offline works without a network."""

    def __init__(self, folder: Path):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("train.loggers has 'wandb' but the wandb package is not "
                              "installed: pip install 'megatron-rl[tracking]'") from e
        self.run = wandb.init(dir=str(folder), resume="allow")

    def __call__(self, step: int, row: dict[str, float]) -> None:
        self.run.log(row, step=step)

    def close(self) -> None:
        self.run.finish()


def _open_sink(name: str, folder: Path):
    sinks = {"tensorboard": _TensorBoard, "wandb": _WandB}
    if name not in sinks:
        raise ValueError(f"rl.loggers: unknown sink {name!r}; known: {', '.join(sinks)}")
    folder.mkdir(parents=True, exist_ok=True)
    return sinks[name](folder)


def _fmt(v: Any) -> str:
    return f"{v:.5g}" if isinstance(v, float) else str(v)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (no display on a training host)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def panels(count: int, width: float = 4.5, height: float = 3.2) -> tuple[Any, list[Any]]:
    """A figure of `count` panels, three to a row: (figure, the `count` axes); the grid's
    spare cells are hidden."""
    cols = min(3, max(1, count))
    nrows = max(1, math.ceil(count / cols))
    fig, axes = pyplot().subplots(nrows, cols, figsize=(width * cols, height * nrows),
                                  squeeze=False)
    for ax in list(axes.flat)[count:]:
        ax.axis("off")
    return fig, list(axes.flat)[:max(count, 1)]


def plot_metrics(rows: list[dict[str, Any]], keys: tuple[str, ...], out: Path) -> Path:
    """One panel per metric against step; written atomically as a PNG."""
    keys = tuple(k for k in keys if any(k in r for r in rows))
    fig, axes = panels(len(keys))
    for ax, key in zip(axes, keys, strict=False):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return save_figure(fig, out)


def save_figure(fig: Any, out: Path) -> Path:
    """A matplotlib figure as a PNG at `out`, written atomically; the figure is closed."""
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    pyplot().close(fig)
    tmp.replace(out)
    return out
