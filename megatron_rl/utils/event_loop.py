"""The driver's event loop: `asyncio.Runner`, with results handed back cheaply."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Runner(asyncio.Runner):
    """`asyncio.Runner` whose `run` returns the coroutine's result without its task holding it.

    Since Python 3.11, until CPython fixed gh-112559 (3.12.1, this project's Python, still has
    it), `Runner.run` built the task's repr twice on the way out:
    `signal.getsignal` and `signal.signal` try `Handlers(handler)` on the SIGINT handler, a
    partial holding the task, and the failed lookup's message formats it, result included.
    A step's rollouts, token lists and all, took ~5 ms a repr (measured on 3.12.1)."""

    def run[T](self, coro: Coroutine[Any, Any, T], *, context: Any = None) -> T:
        box: list[T] = []

        async def into_box() -> None:
            box.append(await coro)

        super().run(into_box(), context=context)
        return box[0]
