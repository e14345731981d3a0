"""User code that misbehaves on purpose, as real environments, tools and rewards do: plain (blocking)
functions that hang, raise, crash their process or sleep. ``scripts/bench/faults.py`` runs the demos with
them; a run (or a pool worker) imports them by path with ``scripts/bench`` on ``PYTHONPATH``.

Each fault falls at random but reproducibly: drawn from a hash of the call's inputs (and, for
environments, the episode's seed and step), never from the process's state, so the same run hits the
same faults whichever worker process serves a call."""

from __future__ import annotations

import hashlib
import os
import time

from asyncrl.demo import calc as calc_demo
from asyncrl.demo import guess, sort
from asyncrl.demo.latency import Latency
from asyncrl.episodes.tools import tool

HANG_S = 60.0  # a "hang": far past every timeout the scenarios set


def draw(*key: object) -> float:
    """A number in [0, 1) fixed by ``key``."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def hanging_sort_reward(prompt: str, completion: str, record: dict) -> float:
    """The sort demo's reward, hanging for a minute on 5% of the prompts (every sample of them)."""
    if draw("hang", prompt) < 0.05:
        time.sleep(HANG_S)
    return sort.reward(prompt, completion, record)


_calls = 0


@tool(name="calc")
def flaky_calc(expression: str) -> str:
    """The demo calculator, plain: on 10% of calls it hangs, on another 10% it raises."""
    global _calls
    _calls += 1
    u = draw("calc", expression, os.getpid(), _calls, time.time_ns())  # per call, not per expression
    if u < 0.1:
        time.sleep(HANG_S)
    if u < 0.2:
        raise RuntimeError("the calculator broke")
    return str(calc_demo.evaluate(expression))


class AbortingGuessEnv:
    """The guess game, plain, whose process dies (``os.abort()``) on 5% of steps."""

    def __init__(self, share: float = 0.05):
        self.share, self.task, self.seed, self.steps = share, None, 0, 0

    def reset(self, task: dict, seed: int) -> None:
        self.task, self.seed, self.steps = task, seed, 0

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        self.steps += 1
        if draw("abort", self.seed, self.steps) < self.share:
            os.abort()
        observation, found = guess.reply(int(self.task["secret"]), action)
        return observation, 1.0 if found else 0.0, found, {}


class SleepyGuessEnv:
    """``asyncrl.demo.guess.Env`` written as blocking code: each step sleeps (``time.sleep``) the same
    seeded delays the async one awaits (``asyncrl.demo.latency``)."""

    def __init__(self, latency_s: float = 0.0, latency_sigma: float = 0.0):
        self.options = {"latency_s": latency_s, "latency_sigma": latency_sigma}
        self.task, self.latency = None, None

    def reset(self, task: dict, seed: int) -> None:
        self.task, self.latency = task, Latency.from_options(self.options, seed)

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        time.sleep(self.latency.next_delay())
        observation, found = guess.reply(int(self.task["secret"]), action)
        return observation, guess.reward(self.task["prompt"], action, self.task), found, {"reply": observation}


class SleepyEnv:
    """``steps`` steps of a blocking ``latency_s`` sleep each (``agentic.py inflight --blocking``)."""

    def __init__(self, steps: int = 3, latency_s: float = 1.0):
        self.steps, self.latency_s, self.done = steps, latency_s, 0

    def reset(self, task: dict, seed: int) -> None:
        self.done = 0

    def step(self, action: str):
        time.sleep(self.latency_s)
        self.done += 1
        return "ok", 0.0, self.done >= self.steps, {}


class LoggedGuessEnv(guess.Env):
    """``asyncrl.demo.guess.Env`` (async, its latency options) that appends one line per step it runs to
    ``log``: ``<episode seed> <step> <action>``. The same seed and step twice is a step run again."""

    def __init__(self, log: str, latency_s: float = 0.0, latency_sigma: float = 0.0):
        super().__init__(latency_s, latency_sigma)
        self.log, self.seed, self.steps = log, 0, 0

    async def reset(self, task: dict, seed: int) -> None:
        await super().reset(task, seed)
        self.seed, self.steps = seed, 0

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        result = await super().step(action)
        self.steps += 1
        with open(self.log, "a") as f:
            f.write(f"{self.seed} {self.steps} {action!r}\n")
        return result
