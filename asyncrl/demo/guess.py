"""The multi-turn demo task: find a secret integer in LOW..HIGH from higher / lower replies.

A record is ``{"prompt": "guess:1-16=", "secret": 11}``. Each model turn is one number and ``</s>``;
the environment answers ``higher;`` (the secret is higher than the guess), ``lower;`` or, for a turn
that is not a whole number, ``invalid;`` (plain byte encoding, mask 0). A right guess ends the
episode with reward 1.0; ``episode.max_turns`` guesses without it end it with 0.0. Bisection finds
15 of the 16 secrets in 4 turns (16 in 5).

Every prompt is the same (the secret is hidden), so there is nothing to hold out: the eval split is
each secret once, and its greedy success rate is exactly the policy's success rate.

Environment latency: each ``step`` waits the episode's delay (``latency_s`` / ``latency_sigma`` of
``episode.options``, the Env's keyword arguments; see ``asyncrl.demo.latency``).
"""

from __future__ import annotations

import random
import re

from asyncrl.demo.latency import Latency

LOW, HIGH = 1, 16
PROMPT = f"guess:{LOW}-{HIGH}="
HIGHER, LOWER, INVALID = "higher;", "lower;", "invalid;"
CORRECT = "correct;"  # the last observation: never shown (the episode ends), but logged in info
# The shipped data files: make_splits(N_TRAIN, DATA_SEED) reproduces them exactly.
N_TRAIN = 1024
DATA_SEED = 5678

_NUMBER = re.compile(r"\s*(-?\d{1,6})\s*")


def make_splits(n_train: int, seed: int) -> tuple[list[dict], list[dict]]:
    """``n_train`` records with uniform secrets, and the eval split: every secret once, in order."""
    rng = random.Random(seed)
    train = [{"prompt": PROMPT, "secret": rng.randint(LOW, HIGH)} for _ in range(n_train)]
    return train, [{"prompt": PROMPT, "secret": s} for s in range(LOW, HIGH + 1)]


def parse_guess(text: str) -> int | None:
    match = _NUMBER.fullmatch(text)
    return int(match.group(1)) if match else None


def reply(secret: int, text: str) -> tuple[str, bool]:
    """The environment's answer to one turn: ``(observation, found)``."""
    guess = parse_guess(text)
    if guess is None:
        return INVALID, False
    if guess == secret:
        return CORRECT, True
    return (HIGHER if secret > guess else LOWER), False


def reward(prompt: str, completion: str, record: dict) -> float:
    """One guess's reward: 1.0 when ``completion`` is the secret, else 0.0 (what ``Env.step`` pays;
    as ``data.reward`` it scores a one-guess game)."""
    del prompt
    return 1.0 if reply(int(record["secret"]), completion)[1] else 0.0


class Env:
    """One game (one instance per episode). Async: a step's latency waits on the event loop."""

    def __init__(self, latency_s: float = 0.0, latency_sigma: float = 0.0):
        self._options = {"latency_s": latency_s, "latency_sigma": latency_sigma}
        Latency.from_options(self._options, 0)  # bad settings fail at the first episode's start
        self._task: dict | None = None
        self._latency: Latency | None = None

    async def reset(self, task: dict, seed: int) -> None:
        """The prompt says it all: no first observation."""
        self._task = task
        self._latency = Latency.from_options(self._options, seed)

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self._task is None or self._latency is None:
            raise RuntimeError("step() before reset()")
        await self._latency.wait()
        observation, found = reply(int(self._task["secret"]), action)
        return observation, reward(self._task["prompt"], action, self._task), found, {"reply": observation}

    async def close(self) -> None:
        self._task = self._latency = None


def bisect(lo: int, hi: int) -> int:
    """The optimal guess in ``lo..hi``: the middle (rounded down)."""
    return (lo + hi) // 2


def lowest(lo: int, hi: int) -> int:
    """The warm-up's weak strategy: the smallest number still possible (consistent, but a linear scan)."""
    del hi
    return lo


def demonstration(record: dict, strategy, turns: int) -> list[tuple[str, bool]]:
    """A warm-up episode as ``(text, is_model_turn)`` segments: ``strategy(lo, hi)`` played against the
    record's secret for up to ``turns`` guesses, each reply as the environment gives it."""
    secret, lo, hi = int(record["secret"]), LOW, HIGH
    segments: list[tuple[str, bool]] = [(record["prompt"], False)]
    for _ in range(turns):
        guess = strategy(lo, hi)
        segments.append((str(guess), True))
        observation, found = reply(secret, str(guess))
        if found:
            break
        segments.append((observation, False))
        lo, hi = (guess + 1, hi) if observation == HIGHER else (lo, guess - 1)
    return segments
