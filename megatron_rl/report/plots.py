"""Report curves of a run from its `metrics.jsonl`: one PNG per theme, drawn by
`utils.metrics.plot_metrics` (one panel per metric against step).

| file | metrics (those the run wrote) |
|---|---|
| `reward_accuracy.png` | `reward/outcome_mean`, `…/sampled_outcome_mean`, `…/pass_rate`, eval |
| `reward_per_role.png` | `reward/<role>_mean`, `reward/<role>_std`, `reward/<role>/<key>_mean` |
| `tool_calls.png` | `tools/calls_mean`, `tools/<name>_calls`, `tools/<name>_error_rate`, turns |
| `abnormal.png` | env / model failure and ok rates, each label's rate that is ever non-zero |
| `mismatch.png` | `mismatch/…` (train vs. rollout log-probs, TIS), `rollout/stale_token_fraction` |
| `sampling.png` | groups kept / dropped / kept for some roles, prompts skipped / cut, seconds |

Across runs: `plot_accuracy` (one bar per model or method, a dot per run: seeds) and
`plot_runs` (a metric per step, one line per method: the mean over its runs, the band their
range).

The roles are the ones the taxonomy counted turns for (`rollout/<role>_turns_mean`). A figure
none of whose metrics is in the file is not written; a value that is not a number is skipped.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from megatron_rl.utils.metrics import panels, plot_metrics, pyplot, read_metrics, save_figure

REWARD_ACCURACY = ("reward/outcome_mean", "rollout/sampled_outcome_mean", "rollout/pass_rate",
                   "rollout/judged_pass_rate", "eval/outcome_mean", "eval/pass_rate",
                   "eval/judged_pass_rate")
FAILURE_TOTALS = ("abnormal/env_failure_rate", "abnormal/model_failure_rate",
                  "abnormal/ok_rate", "rollout/length_finish_rate")
SAMPLING = ("rollout/groups", "rollout/dropped_groups", "rollout/role_groups",
            "rollout/skipped_prompts", "rollout/cancelled_prompts", "time/generate", "time/step")
_ROLE_TURNS = re.compile(r"rollout/([A-Za-z0-9_.-]+)_turns_mean")
_TOOL = re.compile(r"tools/[A-Za-z0-9_.-]+_(calls|error_rate)")
_LABEL_RATE = re.compile(r"abnormal/[a-z_]+_rate")


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def numeric_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that have a numeric step, each with only its numeric values."""
    return [{k: v for k, v in r.items() if _is_number(v)} for r in rows
            if isinstance(r, dict) and _is_number(r.get("step"))]


def report_keys(rows: list[dict[str, Any]]) -> dict[str, tuple[str, ...]]:
    """Figure file name -> the metrics it plots, in order; only keys present in `rows` (numeric
    rows, `numeric_rows`), and only figures with at least one key."""
    present: dict[str, None] = {}
    for r in rows:
        present.update(dict.fromkeys(k for k in r if k != "step"))
    keys = list(present)
    roles = [m.group(1) for k in keys if (m := _ROLE_TURNS.fullmatch(k))]
    per_role = [k for role in roles for k in keys
                if k in (f"reward/{role}_mean", f"reward/{role}_std")
                or k.startswith(f"reward/{role}/")]
    tools = (["tools/calls_mean"] + sorted(k for k in keys if _TOOL.fullmatch(k))
             + ["rollout/turns_mean"] + [f"rollout/{role}_turns_mean" for role in roles])
    labels = sorted(k for k in keys if _LABEL_RATE.fullmatch(k) and k not in FAILURE_TOTALS
                    and any(r.get(k) for r in rows))  # a label never seen is no curve
    figures = {
        "reward_accuracy.png": REWARD_ACCURACY,
        "reward_per_role.png": tuple(per_role),
        "tool_calls.png": tuple(tools),
        "abnormal.png": (*FAILURE_TOTALS, *labels),
        "mismatch.png": (*sorted(k for k in keys if k.startswith("mismatch/")),
                         "rollout/stale_token_fraction"),
        "sampling.png": SAMPLING,
    }
    out = {}
    for name, wanted in figures.items():
        have = tuple(dict.fromkeys(k for k in wanted if k in present))
        if have:
            out[name] = have
    return out


def write_plots(metrics: str | Path | list[dict[str, Any]], out_dir: str | Path
                ) -> dict[str, Path]:
    """The report's PNGs for a run's metrics (the path of its `metrics.jsonl`, or its rows)
    in `out_dir` (created); figure file name -> path, for the figures written."""
    rows = read_metrics(metrics) if isinstance(metrics, str | Path) else list(metrics)
    rows = sorted(numeric_rows(rows), key=lambda r: r["step"])
    out = Path(out_dir)
    figures = report_keys(rows)
    if figures:
        out.mkdir(parents=True, exist_ok=True)
    return {name: plot_metrics(rows, keys, out / name) for name, keys in figures.items()}


def plot_accuracy(values: dict[str, list[float]], out: Path, *, title: str,
                  ylabel: str = "held-out pass@1") -> Path:
    """One bar per label at the mean of its values (runs: seeds), each value a dot on it."""
    have = {k: v for k, v in values.items() if v}
    fig, ax = pyplot().subplots(figsize=(1.3 * max(len(have), 3) + 1.5, 3.6))
    for i, vals in enumerate(have.values()):
        mean = sum(vals) / len(vals)
        ax.bar(i, mean, color="tab:blue", alpha=0.45)
        offsets = [(k - (len(vals) - 1) / 2) * 0.08 for k in range(len(vals))]  # equal ones apart
        ax.scatter([i + o for o in offsets], vals, color="black", s=14, zorder=3)
        ax.annotate(f"{mean:.3f}", (i, mean), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(range(len(have)), list(have), rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, out)


def plot_runs(runs: dict[str, list[list[dict[str, Any]]]], keys: tuple[str, ...], out: Path
              ) -> Path:
    """One panel per metric against step, one line per label: the mean over its runs' rows
    (each run a `metrics.jsonl`'s rows) at every step some run has, shaded between their
    lowest and highest."""
    numeric = {label: [numeric_rows(rows) for rows in per_run] for label, per_run in runs.items()}
    fig, axes = panels(len(keys), 4.8, 3.3)
    for ax, key in zip(axes, keys, strict=False):
        for label, rows_per_run in numeric.items():
            by_step: dict[float, list[float]] = {}
            for rows in rows_per_run:
                for r in rows:
                    if key in r:
                        by_step.setdefault(r["step"], []).append(r[key])
            if not by_step:
                continue
            steps = sorted(by_step)
            mean = [sum(by_step[s]) / len(by_step[s]) for s in steps]
            line, = ax.plot(steps, mean, label=f"{label} ({len(rows_per_run)})")
            ax.fill_between(steps, [min(by_step[s]) for s in steps],
                            [max(by_step[s]) for s in steps], color=line.get_color(),
                            alpha=0.15)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return save_figure(fig, out)
