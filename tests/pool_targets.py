"""User code for ``test_pool.py``, run inside the pool's worker processes: importable there because the
pool hands its workers the test process's ``sys.path`` (which pytest put this folder on)."""

from __future__ import annotations

import asyncio
import os
import time

from asyncrl.errors import EpisodeFailure


def add(a, b, scale=1):
    return {"sum": (a + b) * scale, "pair": (a, b), "pid": os.getpid()}


async def add_later(a, b):
    await asyncio.sleep(0.01)
    return a + b


def pid() -> int:
    return os.getpid()


def fail(message: str):
    raise ValueError(message)


def invalid():
    raise EpisodeFailure("reward_invalid", "not a number")


def sleep(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def hang():
    time.sleep(60)


def abort():
    os.abort()


def exit_with(code: int):
    os._exit(code)


def hog(megabytes: int):
    held = b"x" * (megabytes * 2**20)  # written, so resident
    time.sleep(30)
    return len(held)


def not_json():
    return {1, 2}


class Counter:
    """An Env-like object: its state lives in one worker across calls."""

    def __init__(self, start: int = 0, log: str | None = None):
        self.total, self.log = start, log

    def step(self, n: int):
        self.total += n
        return self.total, os.getpid()

    def hang(self):
        time.sleep(60)

    def abort(self):
        os.abort()

    def close(self):
        if self.log:
            with open(self.log, "w") as f:
                f.write(str(self.total))


class AsyncCounter:
    """Async methods run on one event loop per session: a loop-bound object made in one call works in the next."""

    def __init__(self):
        self.queue: asyncio.Queue | None = None

    async def put(self, item):
        self.queue = self.queue or asyncio.Queue()
        await self.queue.put(item)

    async def get(self):
        return await self.queue.get()


class Tally:
    """A deterministic Env-like object (its results are a function of its calls): replayable."""

    def __init__(self, start: int = 0):
        self.total = start

    def step(self, n: int) -> int:
        self.total += n
        return self.total

    def slow_step(self, n: int, seconds: float) -> int:
        time.sleep(seconds)
        return self.step(n)

    def abort(self):
        os.abort()


class Clock:
    """Not a function of its calls: each step returns the time, so a replay never matches."""

    def step(self) -> int:
        return time.monotonic_ns()


def reward(prompt: str, completion: str, record: dict):
    """A reward as ``data.reward`` names one, whose completion says how it behaves (``asyncrl.rewards.batch``)."""
    if completion == "raise":
        raise ValueError(f"cannot score {prompt}")
    if completion == "hang":
        time.sleep(60)
    if completion == "set":
        return {1, 2}  # not JSON
    if completion == "nap":
        time.sleep(0.2)
    return len(completion) + record["bonus"]
