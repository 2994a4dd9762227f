"""An offline HTML viewer of trajectory dumps (`trajectories.jsonl` of a run or an eval).

`write_viewer(rows, out_path)` writes one self-contained HTML file: the trajectories, stripped of
their token ids and clipped, are embedded as JSON in a `<script type="application/json">` tag
and drawn by a small inline script. Nothing is fetched: a Content-Security-Policy allows only
that one script (by its hash) and inline styles, so the page works from `file://` and an
injected `<script>` or `<img onerror>` would not run even if it reached the DOM.

Every string in a dump (the question, the model's turns, tool arguments, search results and
pages, the judge's detail) is untrusted. The JSON is escaped so that no `<`, `>` or `&` appears
in the script tag, and the page inserts data only through `textContent`, never `innerHTML`.

Shown per trajectory: step, uid, group, outcome (correct / incorrect / unjudged), labels and
rewards; the question and reference; every turn (role, text, finish reason, tokens, labels,
per-turn rewards and advantages when the dump has them, tool calls with their arguments and
observations, collapsible and clipped; the summary a Synthesizer turn wrote, from
`metadata["summaries"]`); the answer and the judge's verdict. Filters: step, outcome, failure
label and a text search, also read from the URL's fragment
(`trajectories.html#step=3&outcome=incorrect&label=overlong&q=paris`).
"""

from __future__ import annotations

import base64
import collections
import hashlib
import html
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from megatron_rl.records.trajectory import CONTEXT_SHARED, ENV_FAILURES, MODEL_FAILURES, json_safe

MAX_TEXT_CHARS = 12_000        # a turn's text, an answer, a summary
MAX_OBSERVATION_CHARS = 3_000  # a tool call's observation (search results, a page)
MAX_ARGUMENT_CHARS = 2_000     # a tool call's arguments, as JSON
MAX_TRAJECTORIES = 2_000       # the last ones are kept; the page says how many were left out
PASS_THRESHOLD = 1.0           # outcome >= this counts as correct when no verdict is recorded
_METADATA_SHOWN = ("summaries", "judge", "turn_advantages", "advantages")


def read_trajectories(path: str | Path) -> Iterator[dict[str, Any]]:
    """The rows of a `trajectories.jsonl` (a run's or an eval's), one at a time; a line that is
    not a JSON object (e.g. cut by a kill mid-write) is skipped."""
    with Path(path).open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                yield row


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ("" if value is None else str(value))


def _clip(value: Any, limit: int) -> str:
    s = _str(value)
    if len(s) <= limit:
        return s
    return f"{s[:limit]}\n… [clipped: {len(s):,} characters in all]"


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def _numbers(d: Any) -> dict[str, float]:
    if not isinstance(d, dict):
        return {}
    return {str(k): n for k, v in d.items() if (n := _number(v)) is not None}


def _strings(xs: Any) -> list[str]:
    return [str(x) for x in xs] if isinstance(xs, list) else []


def _status(labels: list[str]) -> str:
    for group in (ENV_FAILURES, MODEL_FAILURES):
        for label in labels:
            if label in group:
                return label
    return labels[0] if labels else "ok"


def _outcome(rewards: dict[str, float], judge: Any, pass_threshold: float) -> str:
    if isinstance(judge, dict) and isinstance(judge.get("correct"), bool):
        return "correct" if judge["correct"] else "incorrect"
    if "outcome" in rewards:
        return "correct" if rewards["outcome"] >= pass_threshold else "incorrect"
    return "unjudged"


def _advantage(turn: dict[str, Any], i: int, per_traj: Any) -> float | None:
    for key in ("advantage", "advantages"):
        if (n := _number(turn.get(key))) is not None:
            return n
    if isinstance(per_traj, list) and i < len(per_traj):
        return _number(per_traj[i])
    return None


def _call(c: Any, limits: tuple[int, int, int]) -> dict[str, Any]:
    _, obs, args = limits
    if not isinstance(c, dict):
        return {"name": _clip(c, 200), "args": "", "error": None, "obs": "", "obs_chars": 0}
    try:
        arguments = json.dumps(json_safe(c.get("arguments")), ensure_ascii=False)
    except (TypeError, ValueError):
        arguments = repr(c.get("arguments"))
    observation = _str(c.get("observation"))
    return {"name": _clip(c.get("name"), 200), "args": _clip(arguments, args),
            "error": None if c.get("error") is None else _clip(c.get("error"), 200),
            "obs": _clip(observation, obs), "obs_chars": len(observation)}


def _turn(t: dict[str, Any], i: int, per_traj_adv: Any, limits: tuple[int, int, int]
          ) -> dict[str, Any]:
    ids = t.get("output_ids")
    calls = t.get("tool_calls")
    return {"role": _clip(t.get("role") or "?", 60), "text": _clip(t.get("text"), limits[0]),
            "finish": _clip(t.get("finish_reason") or "", 40),
            "tokens": len(ids) if isinstance(ids, list) else None,
            "context": _context_length(t),
            "labels": _strings(t.get("labels")), "rewards": _numbers(t.get("rewards")),
            "adv": _advantage(t, i, per_traj_adv),
            "calls": [_call(c, limits) for c in calls] if isinstance(calls, list) else [],
            "summary": None}


def _context_length(t: dict[str, Any]) -> int | None:
    """A turn's context length; a dumped turn holds the ids after the `CONTEXT_SHARED`
    ones it shares with the previous turn's feed."""
    ids, shared = t.get("context_ids"), t.get(CONTEXT_SHARED, 0)
    if not isinstance(ids, list):
        return None
    counted = isinstance(shared, int) and not isinstance(shared, bool) and shared > 0
    return len(ids) + (shared if counted else 0)


def view_row(row: dict[str, Any], *, pass_threshold: float = PASS_THRESHOLD,
             max_text_chars: int = MAX_TEXT_CHARS,
             max_observation_chars: int = MAX_OBSERVATION_CHARS,
             max_argument_chars: int = MAX_ARGUMENT_CHARS) -> dict[str, Any]:
    """One trajectory dict (`Trajectory.to_dict()`, with or without a `step`) as the viewer
    shows it: no token ids, long strings clipped, the outcome and the status worked out, each
    summary placed after the Synthesizer turn that wrote it."""
    limits = (max_text_chars, max_observation_chars, max_argument_chars)
    meta = row.get("metadata") if isinstance(row.get("metadata"), dict) else {}
    per_traj_adv = meta.get("turn_advantages", meta.get("advantages"))
    raw_turns = [t for t in row.get("turns") or [] if isinstance(t, dict)]
    turns = [_turn(t, i, per_traj_adv, limits) for i, t in enumerate(raw_turns)]
    # IterSynth appends one summary per Synthesizer message (a run of synthesizer turns: a cut
    # output is continued in a new turn); it goes after the message's last turn
    summaries = meta.get("summaries") if isinstance(meta.get("summaries"), list) else []
    k = 0
    for i, t in enumerate(turns):
        last_of_run = i + 1 == len(turns) or turns[i + 1]["role"] != "synthesizer"
        if t["role"] == "synthesizer" and last_of_run and k < len(summaries):
            t["summary"] = _clip(summaries[k], max_text_chars)
            k += 1
    rewards = _numbers(row.get("rewards"))
    labels = _strings(row.get("labels"))
    judge = meta.get("judge")
    step = row.get("step")
    step = int(step) if _number(step) is not None and float(step).is_integer() else None
    extra = {k: v for k, v in meta.items() if k not in _METADATA_SHOWN}
    return {"step": step, "uid": _clip(row.get("uid") or "", 200),
            "group": _clip(row.get("group_id") or "", 200),
            "question": _clip(row.get("question"), max_text_chars),
            "reference": None if row.get("reference") is None
            else _clip(row.get("reference"), max_text_chars),
            "answer": None if row.get("answer") is None
            else _clip(row.get("answer"), max_text_chars),
            "labels": labels, "status": _status(labels), "rewards": rewards,
            "outcome": _outcome(rewards, judge, pass_threshold),
            "judge": {"correct": judge.get("correct") if isinstance(judge.get("correct"), bool)
                      else None, "detail": _clip(judge.get("detail") or "", max_text_chars)}
            if isinstance(judge, dict) else None,
            "turns": turns,
            "extra": _clip(json.dumps(json_safe(extra), ensure_ascii=False), max_text_chars)
            if extra else ""}


def _script_json(data: Any) -> str:
    """JSON that is inert inside a <script> element: no `<`, `>` or `&` (so no `</script>`,
    `<!--`), no non-ASCII (so lone surrogates and U+2028 pass too); JSON.parse reads it back."""
    text = json.dumps(json_safe(data), ensure_ascii=True, allow_nan=False,
                      separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def write_viewer(rows: Iterable[dict[str, Any]], out_path: str | Path, *,
                 title: str = "megatron-rl trajectories",
                 max_trajectories: int | None = MAX_TRAJECTORIES,
                 pass_threshold: float = PASS_THRESHOLD,
                 max_text_chars: int = MAX_TEXT_CHARS,
                 max_observation_chars: int = MAX_OBSERVATION_CHARS) -> Path:
    """Write the viewer of `rows` (trajectory dicts, e.g. `read_trajectories(path)`) to
    `out_path` (parents created, written atomically) and return its path. Only the last
    `max_trajectories` rows are kept (None: all); the page says how many were left out."""
    kept: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_trajectories)
    total = 0
    for row in rows:
        total += 1
        kept.append(view_row(row, pass_threshold=pass_threshold, max_text_chars=max_text_chars,
                             max_observation_chars=max_observation_chars))
    data = {"title": title, "total": total, "rows": list(kept)}
    digest = base64.b64encode(hashlib.sha256(_SCRIPT.encode("utf-8")).digest()).decode()
    csp = (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
           "img-src 'none'; base-uri 'none'; form-action 'none'")
    page = (_PAGE.replace("@CSP@", csp).replace("@TITLE@", html.escape(title))
            .replace("@STYLE@", _STYLE).replace("@DATA@", _script_json(data))
            .replace("@SCRIPT@", _SCRIPT))
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="@CSP@">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>@TITLE@</title>
<style>@STYLE@</style>
</head>
<body>
<header>
<h1 id="title"></h1>
<div id="filters">
<label>step <select id="f-step"></select></label>
<label>outcome <select id="f-outcome"></select></label>
<label>failure label <select id="f-label"></select></label>
<label>search <input id="f-text" type="search" placeholder="question, answer, turns"></label>
</div>
<div id="counts"></div>
</header>
<main id="list"><noscript>This viewer draws the trajectories with JavaScript.</noscript></main>
<script type="application/json" id="trajectory-data">@DATA@</script>
<script>@SCRIPT@</script>
</body>
</html>
"""

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0; background: #f4f5f7; color: #1d2330; }
header { position: sticky; top: 0; background: #1d2b45; color: #fff; padding: 10px 18px;
  z-index: 1; box-shadow: 0 1px 4px rgba(0,0,0,.3); }
h1 { font-size: 18px; margin: 0 0 6px; }
#filters label { margin-right: 14px; }
#filters select, #filters input { font: inherit; padding: 1px 4px; }
#counts { margin-top: 4px; font-size: 13px; color: #c9d4ea; }
main { padding: 12px 18px; }
.traj { background: #fff; border-radius: 6px; margin: 0 0 14px; padding: 10px 14px;
  border-left: 6px solid #9aa3b2; box-shadow: 0 1px 2px rgba(0,0,0,.12); }
.traj.correct { border-left-color: #2e9d4f; }
.traj.incorrect { border-left-color: #d0473c; }
.meta { font-size: 12px; color: #5b6578; }
.badge { display: inline-block; border-radius: 9px; padding: 0 7px; margin: 0 4px 0 0;
  font-size: 12px; background: #e3e7ee; color: #243047; }
.badge.correct { background: #d6f2dd; color: #1c6b33; }
.badge.incorrect { background: #f8d9d6; color: #8c2219; }
.badge.label { background: #fbe7c2; color: #7a4a00; }
.question { font-size: 15px; font-weight: 600; margin: 6px 0 2px; }
.turn { border: 1px solid #dde2ea; border-radius: 5px; margin: 8px 0; padding: 6px 10px; }
.turn.planner, .turn.agent { background: #f3f7ff; }
.turn.synthesizer { background: #f7f3ff; }
.turn-head { font-size: 12px; color: #3d4a63; }
.turn-head b { text-transform: capitalize; font-size: 13px; color: #1d2b45; }
pre { white-space: pre-wrap; word-break: break-word; margin: 4px 0; font: 12.5px/1.4 ui-monospace,
  Menlo, Consolas, monospace; }
.call { border-left: 3px solid #6b8fd6; padding: 2px 8px; margin: 4px 0; background: #fff; }
.call.error { border-left-color: #d0473c; }
.summary { border-left: 3px solid #8a63d2; background: #fff; padding: 2px 8px; margin: 6px 0; }
.answer { font-weight: 600; margin: 8px 0 2px; }
.verdict.correct { color: #1c6b33; } .verdict.incorrect { color: #8c2219; }
details > summary { cursor: pointer; color: #33528f; font-size: 12px; }
button#more { font: inherit; padding: 4px 12px; margin: 4px 0 20px; }
.empty { color: #5b6578; font-style: italic; }
"""

# Data goes into the page through textContent and option values only.
_SCRIPT = r"""
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("trajectory-data").textContent);
  const ROWS = DATA.rows;
  const PAGE = 50;
  let shown = PAGE;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function num(v) {
    return Number.isInteger(v) ? String(v) : Number(v).toPrecision(4);
  }
  function pairs(obj) {
    return Object.keys(obj).map(function (k) { return k + "=" + num(obj[k]); }).join(", ");
  }
  function addOption(select, value, label) {
    const o = document.createElement("option");
    o.value = value;
    o.textContent = label;
    select.appendChild(o);
  }
  function badge(text, cls) { return el("span", "badge" + (cls ? " " + cls : ""), text); }

  const fStep = document.getElementById("f-step");
  const fOutcome = document.getElementById("f-outcome");
  const fLabel = document.getElementById("f-label");
  const fText = document.getElementById("f-text");
  document.getElementById("title").textContent = DATA.title;

  const steps = Array.from(new Set(ROWS.map(function (r) { return r.step; })));
  steps.sort(function (a, b) { return (a === null ? -1 : a) - (b === null ? -1 : b); });
  addOption(fStep, "*", "all");
  steps.forEach(function (s) { addOption(fStep, String(s), s === null ? "(none)" : String(s)); });
  [["*", "all"], ["correct", "correct"], ["incorrect", "incorrect"], ["unjudged", "unjudged"]]
    .forEach(function (p) { addOption(fOutcome, p[0], p[1]); });
  const labels = Array.from(new Set([].concat.apply([], ROWS.map(function (r) {
    return r.labels; })))).sort();
  addOption(fLabel, "*", "all");
  addOption(fLabel, "ok", "ok (no label)");
  addOption(fLabel, "!ok", "any failure");
  labels.forEach(function (l) { addOption(fLabel, "=" + l, l); });

  function haystack(r) {
    if (r._text === undefined) {
      const parts = [r.question, r.answer || "", r.reference || "", r.uid];
      r.turns.forEach(function (t) {
        parts.push(t.text, t.summary || "");
        t.calls.forEach(function (c) { parts.push(c.name, c.args, c.obs); });
      });
      r._text = parts.join("\n").toLowerCase();
    }
    return r._text;
  }
  function matches(r) {
    if (fStep.value !== "*" && String(r.step) !== fStep.value) return false;
    if (fOutcome.value !== "*" && r.outcome !== fOutcome.value) return false;
    const l = fLabel.value;
    if (l === "ok" && r.labels.length) return false;
    if (l === "!ok" && !r.labels.length) return false;
    if (l.charAt(0) === "=" && r.labels.indexOf(l.slice(1)) < 0) return false;
    const q = fText.value.trim().toLowerCase();
    return !q || haystack(r).indexOf(q) >= 0;
  }

  function callBlock(c) {
    const box = el("div", "call" + (c.error ? " error" : ""));
    const head = el("div");
    head.appendChild(el("b", null, c.name));
    head.appendChild(el("code", null, " " + c.args));
    if (c.error) {
      head.appendChild(document.createTextNode(" "));
      head.appendChild(badge(c.error, "label"));
    }
    box.appendChild(head);
    if (c.obs) {
      const d = el("details");
      d.appendChild(el("summary", null, "observation (" + c.obs_chars + " characters)"));
      d.appendChild(el("pre", null, c.obs));
      box.appendChild(d);
    }
    return box;
  }
  function turnBlock(t, i) {
    const box = el("section", "turn " + t.role);
    const head = el("div", "turn-head");
    head.appendChild(el("span", null, "#" + i + " "));
    head.appendChild(el("b", null, t.role));
    const bits = [];
    if (t.finish) bits.push("finish " + t.finish);
    if (t.tokens !== null) bits.push(t.tokens + " tokens");
    if (t.context !== null) bits.push("context " + t.context);
    if (Object.keys(t.rewards).length) bits.push("rewards " + pairs(t.rewards));
    if (t.adv !== null) bits.push("advantage " + num(t.adv));
    head.appendChild(el("span", null, "  " + bits.join(" · ") + " "));
    t.labels.forEach(function (l) { head.appendChild(badge(l, "label")); });
    box.appendChild(head);
    box.appendChild(t.text ? el("pre", "text", t.text) : el("div", "empty", "(empty output)"));
    t.calls.forEach(function (c) { box.appendChild(callBlock(c)); });
    if (t.summary !== null) {
      const s = el("div", "summary");
      s.appendChild(el("b", null, "Summary after this turn"));
      s.appendChild(el("pre", null, t.summary));
      box.appendChild(s);
    }
    return box;
  }
  function card(r) {
    const box = el("article", "traj " + r.outcome);
    const meta = el("div", "meta");
    meta.appendChild(badge(r.outcome, r.outcome));
    r.labels.forEach(function (l) { meta.appendChild(badge(l, "label")); });
    const bits = ["step " + (r.step === null ? "-" : r.step), r.uid, "group " + r.group,
                  r.turns.length + " turns"];
    if (Object.keys(r.rewards).length) bits.push("rewards " + pairs(r.rewards));
    meta.appendChild(el("span", null, bits.join(" · ")));
    box.appendChild(meta);
    box.appendChild(el("div", "question", r.question));
    if (r.reference !== null) box.appendChild(el("div", "meta", "reference: " + r.reference));
    r.turns.forEach(function (t, i) { box.appendChild(turnBlock(t, i)); });
    box.appendChild(el("div", "answer", "Answer: " + (r.answer === null ? "(none)" : r.answer)));
    if (r.judge) {
      const v = r.judge.correct === null ? "no verdict"
        : (r.judge.correct ? "correct" : "incorrect");
      box.appendChild(el("div", "verdict " + v,
        "Judge: " + v + (r.judge.detail ? " (" + r.judge.detail + ")" : "")));
    }
    if (r.extra) {
      const d = el("details");
      d.appendChild(el("summary", null, "metadata"));
      d.appendChild(el("pre", null, r.extra));
      box.appendChild(d);
    }
    return box;
  }

  function render() {
    const list = document.getElementById("list");
    list.replaceChildren();
    const hits = ROWS.filter(matches);
    const correct = hits.filter(function (r) { return r.outcome === "correct"; }).length;
    let counts = hits.length + " of " + ROWS.length + " trajectories shown";
    if (hits.length) {
      counts += " · " + correct + " correct (" + (100 * correct / hits.length).toFixed(1) + "%)";
    }
    if (DATA.total > ROWS.length) {
      counts += " · the first " + (DATA.total - ROWS.length) + " of the dump left out";
    }
    document.getElementById("counts").textContent = counts;
    if (!hits.length) list.appendChild(el("div", "empty", "No trajectory matches these filters."));
    hits.slice(0, shown).forEach(function (r) { list.appendChild(card(r)); });
    if (hits.length > shown) {
      const more = el("button", null, "show " + Math.min(PAGE, hits.length - shown) + " more");
      more.id = "more";
      more.addEventListener("click", function () { shown += PAGE; render(); });
      list.appendChild(more);
    }
  }
  // the filters live in the URL's fragment too (#step=3&outcome=incorrect&label=overlong&q=x),
  // so a filtered view can be linked to; an unknown value means "all"
  const FILTERS = {step: fStep, outcome: fOutcome, label: fLabel, q: fText};
  function fromHash() {
    const params = new URLSearchParams(location.hash.slice(1));
    Object.keys(FILTERS).forEach(function (k) {
      const f = FILTERS[k];
      const v = params.get(k);
      if (k === "label" && v !== null && v !== "ok" && v !== "!ok" && v !== "*") {
        f.value = "=" + v;
      } else {
        f.value = v === null ? (f === fText ? "" : "*") : v;
      }
      if (f.value === "" && f !== fText) f.value = "*";
    });
  }
  function toHash() {
    const params = new URLSearchParams();
    Object.keys(FILTERS).forEach(function (k) {
      let v = FILTERS[k].value;
      if (k === "label" && v.charAt(0) === "=") v = v.slice(1);
      if (v && v !== "*") params.set(k, v);
    });
    try { history.replaceState(null, "", "#" + params.toString()); } catch (e) { /* file: */ }
  }
  function changed() { shown = PAGE; toHash(); render(); }
  [fStep, fOutcome, fLabel].forEach(function (f) { f.addEventListener("change", changed); });
  fText.addEventListener("input", changed);
  window.addEventListener("hashchange", function () { shown = PAGE; fromHash(); render(); });
  fromHash();
  render();
})();
"""
