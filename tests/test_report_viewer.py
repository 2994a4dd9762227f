"""The offline report: the HTML trajectory viewer (rendered in headless Chromium: its DOM and a
screenshot) and the PNG curves from metrics.jsonl."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from megatron_rl.records.trajectory import ToolCall, Trajectory, Turn
from megatron_rl.report import report_keys, view_row, write_plots, write_report, write_viewer

HOSTILE = "</script><img src=x onerror=alert(1)>"
Q_PARIS = "Which city is the capital of the country whose national anthem is La Marseillaise?"
Q_HOSTILE = f"Who wrote {HOSTILE} the page?"
Q_REACT = "In which year did the Eiffel Tower open?"
NOTES_1 = "France's anthem is La Marseillaise (https://fr.example/anthem)."
NOTES_2 = "Paris is the capital of France (https://fr.example/paris)."
CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not on PATH (tools/ensure_chromium.sh installs it)")


def turn(role: str, text: str, n: int = 3, **kw) -> Turn:
    return Turn(role, [1, 2, 3, 4], list(range(n)), [-0.5] * n, [0] * n, text=text, **kw)


def itersynth_traj(uid: str, question: str, *, correct: bool, hostile: bool = False
                   ) -> Trajectory:
    search = ToolCall("search", {"query": "La Marseillaise country"},
                      observation="[1] La Marseillaise - national anthem of France\n" * 80)
    page = HOSTILE + " Paris is the capital of France." if hostile else "Paris, capital."
    visit = ToolCall("visit", {"url": "https://fr.example/paris", "note": HOSTILE},
                     observation=page)
    traj = Trajectory(uid, "g0", question, reference="Paris", turns=[
        turn("planner", "I should search for the anthem.", tool_calls=[search],
             rewards={"rubric": 0.75}),
        turn("synthesizer", NOTES_1, rewards={"rubric": 1.0}),
        turn("planner", "Now visit the page about Paris.", tool_calls=[visit]),
        turn("synthesizer", NOTES_2),
        turn("planner", "<answer>Paris</answer>" if correct else "<answer>Lyon</answer>"),
    ], answer="Paris" if correct else "Lyon", rewards={"outcome": 1.0 if correct else 0.0},
        metadata={"summaries": [NOTES_1, NOTES_2], "facts": ["France", "Paris"],
                  "judge": {"correct": correct, "detail": "exact match" if correct else HOSTILE},
                  "turn_advantages": [0.5, 0.25, -0.125, 1.0, 2.0]})
    return traj


def react_traj() -> Trajectory:
    broken = ToolCall("search", {"query": "Eiffel Tower opening"}, error="search_error",
                      observation="Error: the search backend timed out")
    traj = Trajectory("r0", "g1", Q_REACT, reference="1889",
                      turns=[turn("agent", "Let me search.", tool_calls=[broken])])
    traj.add_label("search_error", traj.turns[0])
    return traj


def rows() -> list[dict]:
    return ([{"step": 1, **itersynth_traj("s0", Q_PARIS, correct=True).to_dict()},
             {"step": 2, **itersynth_traj("s1", Q_HOSTILE, correct=False, hostile=True)
              .to_dict()},
             {"step": 2, **react_traj().to_dict()}])


def embedded(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="trajectory-data">(.*?)</script>', page,
                  re.S)
    assert m, "no data script"
    return json.loads(m.group(1))


def test_view_row_places_summaries_and_drops_token_ids() -> None:
    v = view_row(rows()[0])
    assert [t["role"] for t in v["turns"]] == ["planner", "synthesizer"] * 2 + ["planner"]
    assert [t["summary"] for t in v["turns"]] == [None, NOTES_1, None, NOTES_2, None]
    assert v["outcome"] == "correct" and v["status"] == "ok" and v["step"] == 1
    assert [t["adv"] for t in v["turns"]] == [0.5, 0.25, -0.125, 1.0, 2.0]
    assert v["turns"][0]["rewards"] == {"rubric": 0.75}
    call = v["turns"][0]["calls"][0]
    assert call["args"] == '{"query": "La Marseillaise country"}'
    assert call["obs_chars"] > len(call["obs"]) > 0 and "clipped" in call["obs"]
    assert "context_ids" not in json.dumps(v) and "facts" in v["extra"]
    # each later turn is dumped as the 4 ids it shares with the previous feed: whole lengths
    assert rows()[0]["turns"][1]["context_ids"] == [] and [t["context"] for t in v["turns"]] \
        == [4] * 5
    bad = view_row(rows()[2])
    assert bad["outcome"] == "unjudged" and bad["status"] == "search_error"
    assert bad["turns"][0]["calls"][0]["error"] == "search_error"
    # an eval dump has no step; a malformed row still shows
    assert view_row({"question": "q", "turns": [None, {"text": 3}]})["turns"][0]["text"] == "3"


def test_page_is_self_contained_and_the_data_inert(tmp_path: Path) -> None:
    path = write_viewer(rows(), tmp_path / "report" / "trajectories.html", title=HOSTILE)
    page = path.read_text(encoding="utf-8")
    assert HOSTILE not in page and "<img" not in page
    # one </script> per script tag: the data cannot close its tag early
    assert page.count("</script>") == 2
    assert not re.search(r"<[a-z]+[^>]*\b(src|href)=", page), "nothing is loaded from anywhere"
    assert "default-src 'none'" in page and "innerHTML" not in page
    data = embedded(page)
    assert data["total"] == 3 and data["title"] == HOSTILE
    assert data["rows"][1]["question"] == Q_HOSTILE
    assert data["rows"][1]["judge"]["detail"] == HOSTILE
    # only the last max_trajectories rows are kept, and the page knows how many there were
    data = embedded(write_viewer(rows(), tmp_path / "v2.html", max_trajectories=1).read_text())
    assert [r["uid"] for r in data["rows"]] == ["r0"] and data["total"] == 3


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        self.tags.append(tag)


def _chromium(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,900",
         f"--user-data-dir={tmp_path / 'chromium-profile'}", "--no-first-run",
         "--disable-dev-shm-usage", *args],
        capture_output=True, text=True, timeout=120, check=False)


def dump_dom(url: str, tmp_path: Path) -> str:
    """What the page's script drew: the DOM from the header to the embedded data (which holds
    every string too, so it is left out)."""
    res = _chromium("--dump-dom", url, tmp_path=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    assert '<main id="list">' in dom and 'id="trajectory-data"' in dom, dom[:2000]
    return dom[dom.index("<header>"):dom.index('<script type="application/json"')]


def screenshot(url: str, out: Path, tmp_path: Path):
    from PIL import Image

    res = _chromium(f"--screenshot={out}", url, tmp_path=tmp_path)
    assert res.returncode == 0 and out.exists(), res.stderr[-2000:]
    return Image.open(out).convert("RGB")


@needs_chromium
def test_viewer_renders_in_headless_chromium(tmp_path: Path) -> None:
    url = write_viewer(rows(), tmp_path / "trajectories.html").resolve().as_uri()
    dom = dump_dom(url, tmp_path)
    # the script ran: every trajectory's question, turns, calls, summaries and verdicts are in
    for text in (Q_PARIS, Q_REACT, NOTES_1, NOTES_2, "Now visit the page about Paris.",
                 "Summary after this turn", "La Marseillaise country", "Answer: Paris",
                 "Judge: correct (exact match)", "advantage -0.1250", "rewards rubric=0.7500",
                 "3 of 3 trajectories shown", "search_error"):
        assert text in dom, text
    assert dom.count('class="traj ') == 3 and dom.count('class="turn ') == 11
    # the hostile strings are text (escaped in the serialised DOM), never elements
    escaped = HOSTILE.replace("<", "&lt;").replace(">", "&gt;")
    assert f"Who wrote {escaped} the page?" in dom
    assert dom.count(escaped) >= 4  # question, page, arguments (JSON), judge's detail
    parser = _Tags()
    parser.feed(dom)
    assert "img" not in parser.tags and "script" not in parser.tags
    assert parser.tags.count("article") == 3

    # the filters, set from the URL's fragment
    incorrect = dump_dom(url + "#outcome=incorrect", tmp_path)
    assert "1 of 3 trajectories shown" in incorrect and "Who wrote" in incorrect
    assert Q_PARIS not in incorrect
    labelled = dump_dom(url + "#label=search_error&step=2", tmp_path)
    assert "1 of 3 trajectories shown" in labelled and Q_REACT in labelled
    none = dump_dom(url + "#step=1&label=search_error", tmp_path)
    assert "0 of 3 trajectories shown" in none and "No trajectory matches" in none


def _ink(img, top: int) -> float:
    """The share of pixels below `top` that are neither the page background nor white."""
    pixels = list(img.crop((0, top, img.width, img.height)).getdata())
    background = {(0xF4, 0xF5, 0xF7), (0xFF, 0xFF, 0xFF)}
    return sum(p not in background for p in pixels) / len(pixels)


@needs_chromium
def test_viewer_screenshot_is_not_blank(tmp_path: Path) -> None:
    url = write_viewer(rows(), tmp_path / "trajectories.html").resolve().as_uri()
    img = screenshot(url, tmp_path / "shot.png", tmp_path)
    assert img.size == (1200, 900)
    colors = img.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 100, "the page is (nearly) one colour"
    # the list under the sticky header holds trajectory cards: text, badges, borders
    assert _ink(img, top=130) > 0.03
    # the same check on a viewer with nothing to show finds the list empty
    empty = write_viewer([], tmp_path / "empty.html").resolve().as_uri()
    assert _ink(screenshot(empty, tmp_path / "empty.png", tmp_path), top=130) < 0.01


def crafted_metrics(path: Path, steps: int = 6) -> Path:
    lines = []
    for s in range(1, steps + 1):
        row = {"step": s, "reward/outcome_mean": s / steps, "rollout/pass_rate": s / steps / 2,
               "rollout/judged_pass_rate": s / steps, "rollout/turns_mean": 5.0 - s / 3,
               "rollout/planner_turns_mean": 3.0, "rollout/synthesizer_turns_mean": 2.0,
               "reward/planner_mean": 0.1 * s, "reward/planner_std": 0.3,
               "reward/synthesizer_mean": 0.05 * s, "reward/synthesizer/rubric_mean": 0.5,
               "tools/calls_mean": 2.0 + s, "tools/search_calls": 10.0 * s,
               "tools/search_error_rate": 0.1, "abnormal/env_failure_rate": 0.1,
               "abnormal/model_failure_rate": 0.2, "abnormal/ok_rate": 0.7,
               "abnormal/overlong_rate": 0.0, "abnormal/search_error_rate": 0.1,
               "mismatch/train_rollout_logprob_abs_diff": 1e-3 / s,
               "mismatch/rollout_is_mean": 1.0, "loss": 0.5, "note": "not a number",
               "rollout/groups": 4, "rollout/dropped_groups": 10 - s, "time/step": 30.0,
               "skipped": False}
        if s % 3 == 0:
            row["eval/pass_rate"] = s / 10
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_report_keys_pick_what_the_file_has(tmp_path: Path) -> None:
    from megatron_rl.report.plots import numeric_rows
    from megatron_rl.utils.metrics import read_metrics

    keys = report_keys(numeric_rows(read_metrics(crafted_metrics(tmp_path / "m.jsonl"))))
    assert keys["reward_accuracy.png"] == ("reward/outcome_mean", "rollout/pass_rate",
                                           "rollout/judged_pass_rate", "eval/pass_rate")
    assert keys["reward_per_role.png"] == ("reward/planner_mean", "reward/planner_std",
                                           "reward/synthesizer_mean",
                                           "reward/synthesizer/rubric_mean")
    assert keys["tool_calls.png"] == (
        "tools/calls_mean", "tools/search_calls", "tools/search_error_rate", "rollout/turns_mean",
        "rollout/planner_turns_mean", "rollout/synthesizer_turns_mean")
    # a label that never happened is no curve; strings and booleans are not metrics
    assert keys["abnormal.png"] == ("abnormal/env_failure_rate", "abnormal/model_failure_rate",
                                    "abnormal/ok_rate", "abnormal/search_error_rate")
    assert keys["mismatch.png"] == ("mismatch/rollout_is_mean",
                                    "mismatch/train_rollout_logprob_abs_diff")
    assert keys["sampling.png"] == ("rollout/groups", "rollout/dropped_groups", "time/step")
    assert report_keys([{"step": 1, "loss": 1.0}]) == {}


def test_plots_are_written(tmp_path: Path) -> None:
    written = write_plots(crafted_metrics(tmp_path / "metrics.jsonl"), tmp_path / "report")
    assert sorted(written) == ["abnormal.png", "mismatch.png", "reward_accuracy.png",
                               "reward_per_role.png", "sampling.png", "tool_calls.png"]
    for path in written.values():
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, path
    # a run without the keys of a figure does not get that figure
    only = write_plots([{"step": 1, "reward/outcome_mean": 0.0},
                        {"step": 2, "reward/outcome_mean": 0.5}], tmp_path / "few")
    assert list(only) == ["reward_accuracy.png"]
    assert write_plots([], tmp_path / "none") == {} and not (tmp_path / "none").exists()


def test_write_report_of_a_run_dir(tmp_path: Path) -> None:
    crafted_metrics(tmp_path / "metrics.jsonl")
    (tmp_path / "trajectories.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows()) + '{"step": 3, "uid": "cut mid-wr')
    written = write_report(tmp_path)
    assert written["trajectories.html"] == tmp_path / "report" / "trajectories.html"
    assert len(written) == 7
    assert embedded(written["trajectories.html"].read_text())["total"] == 3
