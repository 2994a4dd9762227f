"""The driver's `utils.event_loop.Runner`: `run` gives back the coroutine's result, never
builds its repr (Python 3.12.1's `asyncio.Runner` did, twice per run), and keeps the
runner's Ctrl-C handling: the coroutine is cancelled, its cleanup runs, KeyboardInterrupt."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from megatron_rl.utils.event_loop import Runner


class Rollouts:
    """A result whose repr is expensive (a step's rollouts): counts the times it is built."""

    reprs = 0

    def __repr__(self) -> str:
        Rollouts.reprs += 1
        return "Rollouts(...)"


def test_run_returns_the_result_without_building_its_repr() -> None:
    async def collect(step: int) -> tuple[int, Rollouts]:
        await asyncio.sleep(0)
        return step, Rollouts()

    Rollouts.reprs = 0
    with Runner() as loop:
        results = [loop.run(collect(step)) for step in range(3)]
    assert [step for step, _ in results] == [0, 1, 2]
    assert all(isinstance(r, Rollouts) for _, r in results)
    assert Rollouts.reprs == 0


def test_an_error_in_the_coroutine_reaches_the_caller_and_the_loop_goes_on() -> None:
    async def fail() -> None:
        raise ValueError("judge reply: not JSON")

    async def answer() -> int:
        return 42

    with Runner() as loop:
        with pytest.raises(ValueError, match="not JSON"):
            loop.run(fail())
        assert loop.run(answer()) == 42


def test_ctrl_c_cancels_the_coroutine_runs_its_cleanup_and_raises_keyboard_interrupt() -> None:
    cleaned: list[str] = []

    async def long_step() -> None:
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGINT)
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.append("engines stopped")

    # asyncio.Runner takes Ctrl-C only over Python's default handler, as at a program's start;
    # this test must not depend on what earlier tests in the process left there
    left = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with Runner() as loop, pytest.raises(KeyboardInterrupt):
            loop.run(long_step())
        assert cleaned == ["engines stopped"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, left)
