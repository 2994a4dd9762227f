"""The degeneracy detector (utils.degeneracy) and the trajectory filters (data.filters) on
crafted positive and negative cases."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import string
from pathlib import Path

import pytest

from megatron_rl.agents.base import is_degenerate as agent_is_degenerate
from megatron_rl.data.filters import (
    Correctness,
    Dedup,
    Degeneracy,
    Depth,
    add_filter_parser,
    default_pipeline,
    filter_file,
)
from megatron_rl.records.trajectory import ToolCall, Trajectory, Turn
from megatron_rl.utils.degeneracy import (
    DEFAULT,
    DegeneracyConfig,
    _may_compress,
    char_run_finding,
    compression_finding,
    find_degeneracy,
    line_loop_finding,
)

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the capital search result page population river founded century museum city "
         "bridge treaty king queen railway station mountain border census election").split()


def fluent(n_chars: int, seed: int = 0) -> str:
    """Prose-like text with varied sentences (no loop at any scale)."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_chars:
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 14))]
        sent = " ".join(words).capitalize() + f" in {rng.randint(1000, 2024)}, " \
            f"page {rng.randint(1, 999)}. "
        out.append(sent)
        size += len(sent)
    return "".join(out)


def loop(unit: str, n_chars: int) -> str:
    return (unit * (n_chars // len(unit) + 1))[:n_chars]


# -- the detector ----------------------------------------------------------------------------

def test_fluent_text_docs_and_code_pass() -> None:
    assert find_degeneracy(fluent(50_000)) is None
    for path in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "megatron_rl/agents/base.py",
                 ROOT / "configs/rubrics/planner.json"]:
        assert find_degeneracy(path.read_text()) is None, path
    # deeply nested JSON ends in 500 closing braces: legitimate, not a character run
    nested = "".join(f'{{"{random.Random(i).getrandbits(32):08x}": ' for i in range(500)) \
        + "1" + "}" * 500
    assert find_degeneracy(nested) is None
    assert find_degeneracy("short " * 10) is None and find_degeneracy("") is None


def test_loop_whose_period_the_window_does_not_divide_is_caught() -> None:
    cfg = DegeneracyConfig(window=2048)
    unit = fluent(337, seed=3)[:337]  # 337 is prime: no window boundary lines up with it
    assert 2048 % len(unit) != 0
    text = fluent(5_000, seed=1) + loop(unit, 6_000) + fluent(3_000, seed=2)
    found = compression_finding(text.encode(), cfg)
    assert found is not None and found.kind == "compression"
    assert 5_000 - 2048 < found.offset < 5_000 + 2 * 2048  # at the loop, not before it
    assert float(found.detail.split("ratio ")[1].split()[0]) < 0.05
    # a period longer than the window (a whole paragraph repeated) is caught too: the ratio is
    # taken given the 32 KB before the window
    para = fluent(3_000, seed=4)
    assert compression_finding((fluent(2_000) + para * 4).encode(), cfg) is not None
    # the same amount of fluent text is not
    assert compression_finding(fluent(14_000, seed=5).encode(), cfg) is None


def test_threshold_is_configurable() -> None:
    text = fluent(20_000).encode()
    assert compression_finding(text) is None
    assert compression_finding(text, DegeneracyConfig(max_ratio=0.9)) is not None


def test_periodically_repeating_lines() -> None:
    block = "Let me search for the capital again.\nSearching now.\nNo luck yet, retry."
    text = fluent(300) + "\n" + "\n".join([block] * 4) + "\nDone."
    found = line_loop_finding(text.encode())
    assert found is not None and found.kind == "line_loop" and "3 line(s) repeated 4" \
        in found.detail
    assert line_loop_finding(("\n".join([block] * 3)).encode()) is None  # 3 copies: allowed
    # short lines (braces, rulers, blank) never count; distinct lines never match
    assert line_loop_finding(("}\n---\n\n" * 50).encode()) is None
    assert line_loop_finding("\n".join(fluent(60, seed=i) for i in range(200)).encode()) is None


def test_single_character_runs() -> None:
    assert char_run_finding(("ok " + "!" * 300).encode()) is not None
    assert char_run_finding(("ok " + "!" * 200).encode()) is None  # under max_char_run=256
    cjk = "答案是" + "。" * 100  # 300 bytes: a 3-byte character repeated
    found = char_run_finding(cjk.encode())
    assert found is not None and found.kind == "char_run"
    assert char_run_finding(("x" + "ha" * 150).encode()) is not None  # period 2
    assert char_run_finding(("=" * 80 + "\n" + fluent(500)).encode()) is None  # a ruler
    assert char_run_finding(("x" + "]" * 1000).encode()) is None  # closing brackets: exempt
    for i in range(300, 320):  # every alignment of the run against the sampling grid
        text = fluent(i) + "z" * 256 + fluent(100, seed=9)
        assert char_run_finding(text.encode()) is not None, i
        assert char_run_finding((fluent(i) + "z" * 255 + "y").encode()) is None, i


def test_agent_label_uses_the_same_detector() -> None:
    looping = "<think>" + "the the the " * 100 + "</think>"
    assert agent_is_degenerate(looping) and find_degeneracy(looping) is not None
    assert not agent_is_degenerate(fluent(3_000))
    assert agent_is_degenerate(fluent(5_000) + loop("I will check again. ", 5_000))


def prose(n_chars: int, seed: int = 0) -> str:
    """Fluent text over an open vocabulary (made-up words): it repeats no 16 bytes."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_chars:
        words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
                 for _ in range(rng.randint(5, 14))]
        sent = " ".join(words).capitalize() + f" ({rng.randint(1, 9999)}). "
        out.append(sent)
        size += len(sent)
    return "".join(out)


def test_long_texts_are_screened_without_changing_the_findings() -> None:
    # from screen_min_bytes on, only windows that may repeat earlier text are compressed,
    # by a stream primed with the text before them: the findings are those of compressing
    # every window
    every_window = DegeneracyConfig(screen_min_bytes=1 << 62)
    prefix = prose(200_000, seed=1)  # longer than a stream's priming
    unit = prose(1_000, seed=5)[:1_000]
    mutated = "".join(chr(97 + i // 50 % 26) if i % 50 == 0 else c  # a new byte every 50
                      for i, c in enumerate(loop(unit, 20_000)))
    loops = [prefix + loop(prose(337, seed=3)[:337], 6_000) + prose(3_000, seed=2),
             prefix + prose(3_000, seed=4) * 4,  # a period longer than the window
             prefix + "".join(f"Attempt {i}: search the capital page again.\n"
                              for i in range(400)),  # a counter: no two lines alike
             prefix + mutated]
    for text in loops:
        raw = text.encode()
        assert len(raw) >= DEFAULT.screen_min_bytes
        found = compression_finding(raw, every_window)
        assert found is not None and found.offset >= len(prefix) - 2048
        assert compression_finding(raw) == found
        assert find_degeneracy(raw) == found
    sound = (prose(150_000, seed=6) + "\n").encode()
    assert compression_finding(sound) is None and compression_finding(sound, every_window) is None
    # which is what makes it fast: nearly no window of prose is compressed
    assert _may_compress(sound, 0, len(sound), 2048).mean() < 0.02


def test_screen_only_where_calibrated() -> None:
    raw = (prose(100_000) + loop("Let me look again. ", 5_000)).encode()
    for cfg in (DegeneracyConfig(max_ratio=0.5), DegeneracyConfig(level=6),
                DegeneracyConfig(window=512), DegeneracyConfig(screen_min_bytes=len(raw) + 1)):
        assert compression_finding(raw, cfg) == compression_finding(
            raw, dataclasses.replace(cfg, screen_min_bytes=1 << 62))
    assert compression_finding(prose(100_000).encode(), DegeneracyConfig(max_ratio=0.9))


# -- trajectories ----------------------------------------------------------------------------

def call(name: str = "search", error: str | None = None, obs: str = "results",
         **arguments: object) -> ToolCall:
    return ToolCall(name, dict(arguments), error, obs)


def turn(text: str, calls: list[ToolCall] | None = None, finish: str = "stop") -> Turn:
    ids = [ord(c) % 100 for c in text[:8]] or [1]
    return Turn("agent", [1, 2], ids, [0.0] * len(ids), [0] * len(ids),
                tool_calls=calls or [], text=text, finish_reason=finish)


def traj(turns: list[Turn], uid: str = "u", answer: str | None = "Paris",
         correct: bool | None = True, labels: list[str] | None = None,
         question: str = "What is the capital of France?") -> Trajectory:
    meta = {"judge": {"correct": correct, "detail": ""}} if correct is not None else {}
    return Trajectory(uid, "g", question, "Paris", turns, answer, labels or [],
                      {"outcome": 1.0 if correct else 0.0}, meta)


def good(uid: str = "u", query: str = "capital of france") -> Trajectory:
    return traj([turn("I search.", [call(query=query)]),
                 turn("I visit.", [call("visit", url="https://x/paris")]),
                 turn("<answer>Paris</answer>")], uid)


def test_correctness() -> None:
    f = Correctness()
    assert f(good()) is None
    assert f(traj(good().turns, correct=False)) == "incorrect"
    assert f(traj(good().turns, labels=["search_error"])) == "env_failure:search_error"
    assert f(traj(good().turns, labels=["max_turns"])) == "model_failure:max_turns"
    assert f(traj(good().turns, answer=None)) == "no_answer"
    cut = traj([turn("I search.", [call(query="q")]), turn("<answer>Par", finish="length")])
    assert f(cut) == "cut:length"
    # no judge record: the outcome reward decides
    unrecorded = traj(good().turns, correct=None)
    unrecorded.rewards["outcome"] = 1.0
    assert f(unrecorded) is None
    unrecorded.rewards["outcome"] = 0.5
    assert f(unrecorded) == "incorrect"
    unrecorded.rewards.clear()
    assert f(unrecorded) == "unjudged"
    # a recorded verdict wins over the reward (it is what the reward came from)
    judged_none = traj(good().turns)
    judged_none.metadata["judge"]["correct"] = None
    assert f(judged_none) == "incorrect"


def test_degeneracy_filter() -> None:
    f = Degeneracy()
    assert f(good()) is None
    assert f(traj(good().turns, labels=["degenerate"])) == "label"
    looping = traj([turn(fluent(1_000) + loop("search again. ", 4_000), [call(query="a")])])
    assert f(looping) == "compression"
    # consecutive calls, byte-identical arguments (key order does not matter: canonical JSON)
    same = traj([turn("a", [call(query="paris", k=3)]), turn("b", [call(k=3, query="paris")]),
                 turn("<answer>Paris</answer>")])
    assert f(same) == "identical_calls"
    within = traj([turn("a", [call(query="paris"), call(query="paris")])])
    assert f(within) == "identical_calls"
    # not consecutive, or different arguments, or a retry after an error: kept
    apart = traj([turn("a", [call(query="paris")]), turn("b", [call("visit", url="u")]),
                  turn("c", [call(query="paris")])])
    assert f(apart) is None
    assert f(traj([turn("a", [call(query="paris")]), turn("b", [call(query="Paris")])])) is None
    retry = traj([turn("a", [call(query="paris", error="search_error")]),
                  turn("b", [call(query="paris")])])
    assert f(retry) is None


def test_depth_filter() -> None:
    f = Depth(2)
    assert f(good()) is None
    shallow = traj([turn("a", [call(query="q")]), turn("<answer>Paris</answer>")])
    assert f(shallow) == "below_2"
    # a turn whose only call never ran (parse error) is no depth
    parse = traj([turn("a", [call(query="q")]), turn("b", [call(error="tool_parse_error")])])
    assert f(parse) == "below_2"
    # several calls in one turn are one turn
    assert f(traj([turn("a", [call(query="q"), call(query="r")])])) == "below_2"
    assert Depth(3)(good()) == "below_3"


def test_dedup_keeps_distinct_rollouts_of_one_question() -> None:
    f = Dedup()
    assert f(good("u1")) is None
    assert f(good("u2")) == "duplicate"  # same messages, another uid: a duplicate
    assert f(good("u3", query="france capital city")) is None  # another rollout: stays
    other_q = good("u4")
    other_q.question = "Capital of France?"
    assert f(other_q) is None
    obs = good("u5")
    obs.turns[0].tool_calls[0].observation = "other results"
    assert f(obs) is None


def test_pipeline_file_counts_every_drop(tmp_path: Path) -> None:
    rows = [good("a"), good("b", query="paris"), good("c"),  # c duplicates a
            traj(good().turns, "d", correct=False),
            traj([turn("x", [call(query="q")]), turn("<answer>Paris</answer>")], "e"),
            traj(good().turns, "f", labels=["degenerate"])]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"step": i, **t.to_dict()}) for i, t in enumerate(rows)]
    src.write_text("\n".join(lines[:3]) + "\nnot json\n" + "\n".join(lines[3:]) + "\n")
    pipe = default_pipeline(min_depth=2)
    report = filter_file(src, dst, pipe)
    kept = dst.read_text().splitlines()
    assert kept == [lines[0], lines[1]]  # written unchanged, "step" included
    assert report["kept"] == 2
    f = report["filters"]
    assert f["read"] == {"seen": 7, "dropped": 1, "reasons": {"JSONDecodeError": 1}}
    assert f["correctness"] == {"seen": 6, "dropped": 2,
                                "reasons": {"incorrect": 1, "model_failure:degenerate": 1}}
    assert f["degeneracy"]["seen"] == 4 and f["degeneracy"]["dropped"] == 0
    assert f["depth"] == {"seen": 4, "dropped": 1, "reasons": {"below_2": 1}}
    assert f["dedup"] == {"seen": 3, "dropped": 1, "reasons": {"duplicate": 1}}
    assert "dedup" in pipe.summary() and "duplicate 1" in pipe.summary()


def test_cli_parser(tmp_path: Path) -> None:
    src, dst, rep = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "r.json"
    src.write_text(json.dumps({"step": 1, **good().to_dict()}) + "\n")
    parser = argparse.ArgumentParser()
    add_filter_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["filter", str(src), str(dst), "--min-depth", "3",
                              "--report", str(rep)])
    assert args.func(args) == 0
    assert dst.read_text() == ""
    assert json.loads(rep.read_text())["filters"]["depth"]["reasons"] == {"below_3": 1}


@pytest.mark.parametrize("bad", [{"window": 10}, {"max_ratio": 0}, {"max_char_run": 4},
                                 {"screen_min_bytes": -1}])
def test_config_is_checked(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DegeneracyConfig(**bad)
