"""Simulated environment latency for the agentic demos: how long one environment step or tool call takes.

Two options of ``episode.options`` set it: ``latency_s`` (the median delay of one step, seconds; 0: none)
and ``latency_sigma`` (0: every step takes exactly ``latency_s``; > 0: log-normal delays with that
median and ``sigma`` of ``log(delay)``, a heavy tail of slow steps like a real service's).

Reproducible: an episode's delays come from its own generator seeded by the episode's seed, so the n-th
step of an episode waits the same time in every run. Concurrency: the waits are ``asyncio.sleep``, so
any number of episodes can be waiting on one event loop at once; none holds a thread.

A tool has no episode handle, so an episode makes its :class:`Latency` the current one for its own
asyncio task with :func:`active`; a tool awaits :func:`pause`. A contextvar is the seam because an
asyncio task sees only its own (and its parent's, copied at its start) values: concurrent episodes
never draw from each other's delays, and outside an episode :func:`pause` waits nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import random
from collections.abc import Iterator, Mapping
from typing import Any

_CURRENT: contextvars.ContextVar[Latency | None] = contextvars.ContextVar("asyncrl_demo_latency", default=None)


class Latency:
    """One episode's step delays: ``median_s`` each, or log-normal around it when ``sigma`` > 0."""

    def __init__(self, median_s: float = 0.0, sigma: float = 0.0, seed: int = 0):
        if not (math.isfinite(median_s) and median_s >= 0):
            raise ValueError(f"latency_s must be a finite number >= 0, not {median_s!r}")
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"latency_sigma must be a finite number >= 0, not {sigma!r}")
        self.median_s, self.sigma = float(median_s), float(sigma)
        # A string seed is hashed deterministically (sha512), never by the per-process str hash; the
        # prefix keeps these draws apart from any other generator seeded by the same episode seed.
        self._rng = random.Random(f"asyncrl.demo.latency/{seed}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any], seed: int) -> Latency:
        """The latency ``episode.options`` ask for (``latency_s``, ``latency_sigma``) for one episode."""
        return cls(float(options.get("latency_s", 0.0)), float(options.get("latency_sigma", 0.0)), seed)

    def next_delay(self) -> float:
        """Seconds the next step takes: exp(N(log median, sigma^2)), whose median is ``median_s``."""
        if self.median_s == 0.0:
            return 0.0
        if self.sigma == 0.0:
            return self.median_s
        return self.median_s * math.exp(self._rng.gauss(0.0, self.sigma))

    async def wait(self) -> float:
        """Sleep for the next delay (on the event loop); return it."""
        delay = self.next_delay()
        if delay > 0:
            await asyncio.sleep(delay)
        return delay


@contextlib.contextmanager
def active(latency: Latency) -> Iterator[Latency]:
    """Make ``latency`` what :func:`pause` waits on, in this asyncio task and the tasks it starts."""
    token = _CURRENT.set(latency)
    try:
        yield latency
    finally:
        _CURRENT.reset(token)


async def pause() -> float:
    """Wait the current episode's next delay (none outside an episode); return it."""
    latency = _CURRENT.get()
    return await latency.wait() if latency is not None else 0.0
