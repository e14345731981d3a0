"""Environments, tools, rewards and episodes that misbehave on purpose, importable by path
(``episode_fixtures:RaisingEnv``) from a test's generator or launch (tests/ is on their path)."""

from __future__ import annotations

import asyncio
import time

from asyncrl.episodes.tools import tool

FOREVER_S = 3600.0  # a "hang": far past any timeout a test sets


class CountingEnv:
    """Two turns: the observation echoes the turn's length; reward 1 per turn."""

    def __init__(self, turns: int = 2):
        self.turns, self.done = turns, 0

    async def reset(self, task: dict, seed: int) -> str:
        return "go:"

    async def step(self, action: str):
        self.done += 1
        return f"<{len(action)}>", 1.0, self.done >= self.turns, {}

    async def close(self) -> None:
        pass


class RaisingEnv(CountingEnv):
    """Raises in ``step`` for every episode whose seed is divisible by ``every``, or, given ``share``,
    for that share of the episodes (episode seeds are well mixed: the failures fall at random)."""

    def __init__(self, every: int = 3, turns: int = 2, share: float | None = None):
        super().__init__(turns)
        self.every, self.share = every, share

    async def reset(self, task: dict, seed: int) -> str:
        self.seed = seed
        return "go:"

    async def step(self, action: str):
        if self.seed % self.every == 0 if self.share is None else self.seed % 1000 < self.share * 1000:
            raise RuntimeError("the environment broke")
        return await super().step(action)


class HangingEnv(CountingEnv):
    async def step(self, action: str):
        await asyncio.sleep(FOREVER_S)


class PlainSlowEnv(CountingEnv):
    """A plain (not async) environment: its steps run on worker threads."""

    def reset(self, task: dict, seed: int) -> str:
        return "go:"

    def step(self, action: str):
        time.sleep(0.05)
        self.done += 1
        return "ok", 0.5, self.done >= self.turns, {}

    def close(self) -> None:
        pass


@tool(timeout_s=0.5)
async def stuck(text: str) -> str:
    """Never answers."""
    await asyncio.sleep(FOREVER_S)
    return text


@tool
def broken(text: str) -> str:
    """Always raises."""
    raise ValueError(f"cannot handle {text!r}")


@tool
def upper(text: str) -> str:
    """The text in capitals.

    Args:
        text: what to shout
    """
    return text.upper()


def reward_len(prompt: str, completion: str, record: dict) -> float:
    return min(len(completion), 4) / 4


def reward_raises_on_a_third(prompt: str, completion: str, record: dict) -> float:
    if record["prompt"] in ("sort:cba=",):
        raise ZeroDivisionError("a bug in the reward")
    return 1.0


def reward_always_raises(prompt: str, completion: str, record: dict) -> float:
    raise KeyError("answer")


def reward_string(prompt: str, completion: str, record: dict):
    return "1.0"


def reward_nan(prompt: str, completion: str, record: dict) -> float:
    return float("nan")


async def reward_hangs(prompt: str, completion: str, record: dict) -> float:
    await asyncio.sleep(FOREVER_S)
    return 1.0


def reward_sleeps(prompt: str, completion: str, record: dict) -> float:
    """A plain reward that sleeps past a short timeout (its thread ends a little later)."""
    time.sleep(1.5)
    return 1.0


async def runaway(ctx) -> float:
    """Keeps generating until the budget runs out."""
    while True:
        await ctx.generate()
        ctx.observe("more")
