"""Offline reports of a run (docs/report.md): an HTML trajectory viewer (`viewer.py`) and PNG
curves from `metrics.jsonl` (`plots.py`). Reads only the run's files; imports only the shared
records and utils."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.report.plots import report_keys, write_plots
from megatron_rl.report.viewer import read_trajectories, view_row, write_viewer

__all__ = ["read_trajectories", "report_keys", "view_row", "write_plots", "write_report",
           "write_viewer"]


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> dict[str, Path]:
    """`run_dir/report/` (or `out_dir`): `trajectories.html` from the run's (or an eval's)
    `trajectories.jsonl` and the PNG curves from its `metrics.jsonl`, each when its input
    exists; name -> path of what was written."""
    run = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run / "report"
    written: dict[str, Path] = {}
    dump = run / "trajectories.jsonl"
    if dump.exists():
        written["trajectories.html"] = write_viewer(
            read_trajectories(dump), out / "trajectories.html",
            title=f"megatron-rl trajectories: {run.resolve().name}")
    if (run / "metrics.jsonl").exists():
        written.update(write_plots(run / "metrics.jsonl", out))
    return written
