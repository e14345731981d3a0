"""Environments that ``asyncrl env-serve`` serves in tests (``env_serve_fixtures:CountingEnv``): they count
their steps in a file, name the worker process they live in, and hang, raise or die on request.

Options (the class's keyword arguments): ``log``, a file each step and close appends a line to (the
steps a server really ran, whatever the HTTP layer answered); ``turns``, steps until ``done``.
Actions: ``hang`` (an hour), ``raise``, ``die`` (the worker exits), ``slow`` (half a second), anything
else a plain step.
"""

from __future__ import annotations

import asyncio
import os
import time

FOREVER_S = 3600.0  # a "hang": far past any deadline a test sets


class CountingEnv:
    """Plain (blocking) methods: each step is ``("step N of TASK", 1.0, N >= turns, {"n", "pid"})``."""

    def __init__(self, log: str | None = None, turns: int = 100):
        self.log, self.turns, self.n, self.task = log, turns, 0, None

    def reset(self, task: dict, seed: int) -> str:
        self.task, self.n = task.get("name", "?"), 0
        return f"reset {self.task} seed {seed} pid {os.getpid()}"

    def step(self, action: str):
        if action == "hang":
            time.sleep(FOREVER_S)
        if action == "raise":
            raise ValueError("the environment broke")
        if action == "die":
            os._exit(3)
        if action == "slow":
            time.sleep(0.5)
        self.n += 1
        self._write(f"step {self.task} {self.n} {action}")
        return f"step {self.n} of {self.task}", 1.0, self.n >= self.turns, {"n": self.n, "pid": os.getpid()}

    def close(self) -> None:
        self._write(f"close {self.task}")

    def _write(self, line: str) -> None:
        if self.log:
            with open(self.log, "a") as f:
                f.write(line + "\n")


class AsyncCountingEnv(CountingEnv):
    """The same, ``async``: its coroutines run on its session's own loop in a worker."""

    async def reset(self, task: dict, seed: int) -> str:
        await asyncio.sleep(0)
        self.loop = asyncio.get_running_loop()  # the same loop for every call of the session
        return super().reset(task, seed).replace("reset", "async reset", 1)

    async def step(self, action: str):
        assert asyncio.get_running_loop() is self.loop
        if action == "hang":
            await asyncio.sleep(FOREVER_S)
        if action == "slow":
            await asyncio.sleep(0.5)
            action = "slowed"
        return super().step(action)

    async def close(self) -> None:
        await asyncio.sleep(0)
        super().close()


class BrokenInit:
    """An environment whose construction raises."""

    def __init__(self, **options):
        raise RuntimeError(f"cannot build with {sorted(options)}")

    def reset(self, task: dict, seed: int) -> None: ...

    def step(self, action: str): ...
