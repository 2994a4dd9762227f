"""Smoke test of benchmarks/partial_rollout.py at its --quick size: the real scheduler, forest
and embedded engine. Checks what the benchmark's numbers rest on, not its timing ratio."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "partial_rollout.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_partial_rollout", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module", params=["in-process", "http"])
def results(bench, request):
    cfg = bench.quick_config()
    cfg.client = request.param  # the driver's client, and HTTP to the same engine
    return bench.run_benchmark(cfg)


def test_quick_draws_cut_long_groups(bench):
    """The quick size's premise (see quick_config): short groups beside long ones."""
    cfg = bench.quick_config()
    longest = [max(bench.pareto_messages(cfg.alpha, cfg.cap, cfg.seed, f"q{k}", i)
                   for i in range(cfg.samples)) for k in range(8)]
    assert longest == [1, 6, 1, 8, 4, 2, 1, 5]


def test_agent_follows_the_protocol(bench):
    from megatron_rl.agents.base import Agent
    from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer

    assert isinstance(bench.HeavyTailAgent(tiny_qwen3_tokenizer(), bench.quick_config(), "t"),
                      Agent)


def test_pareto_tail(bench):
    draws = [bench.pareto_messages(1.2, 32, 0, f"q{k}", i) for k in range(2000)
             for i in range(4)]
    assert min(draws) == 1 and max(draws) == 32
    for k in (2, 4, 8):  # P(N >= k) = k^-1.2 within sampling error
        assert abs(sum(d >= k for d in draws) / len(draws) - k ** -1.2) < 0.02


def test_both_modes_train_the_same_groups_per_step(bench, results):
    cfg = bench.quick_config()
    for r in results.values():
        steps = r.warmup + r.steps
        assert len(steps) == cfg.warmup + cfg.steps
        for s in steps:
            assert s.groups == cfg.groups
            assert len(s.messages) == cfg.groups * cfg.samples
            # every trained session ran its drawn messages, resumed or not, as one sequence
            assert s.messages == s.drawn
            assert s.sequences == [1] * len(s.messages)
            assert s.trained == sum(s.messages) * cfg.tokens
            assert s.lost >= 0 and s.pending_after >= 0
            assert s.leftovers == 0  # the cut left nothing on the engine


def test_partial_mode_resumes_cut_sessions_with_stale_tokens(results):
    part = results["partial"].warmup + results["partial"].steps
    assert sum(s.cancelled for s in part) > 0
    assert sum(s.resumed for s in part) > 0
    assert sum(s.stale for s in part) > 0


def test_sync_mode_cuts_nothing(results):
    for s in results["sync"].warmup + results["sync"].steps:
        assert s.cancelled == s.resumed == s.stale == s.lost == 0
        assert s.generated == s.trained and s.pending_after == 0


def test_report_prints_the_ratio(bench, results, capsys):
    ratio = bench.report(bench.quick_config(), results)
    out = capsys.readouterr().out
    assert ratio > 0 and "partial / sync, mean step wall time" in out
    assert "discrete Pareto" in out and ("PASS" in out or "MISS" in out)
