"""What a generator counts about its episodes: the failure limit and the metrics of each report.

``FailureWindow`` is the run's failure limit: over a generator's last ``episode.failure_window``
episodes, more than ``episode.failure_limit`` failed means something is broken (a reward that always
raises, an environment server that is down), and the run stops with one clear error instead of
training on nothing. ``EpisodeStats`` collects one report's figures (episodes, failures by cause,
turns, environment seconds, tokens) and turns them into namespaced metrics.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from asyncrl.episodes.api import Context, Outcome


class FailureWindow:
    def __init__(self, window: int, limit: float):
        self.limit = limit
        self._recent: collections.deque[bool] = collections.deque(maxlen=window)
        self.last_failure: Outcome | None = None

    def add(self, outcome: Outcome) -> None:
        self._recent.append(outcome.cause is not None)
        if outcome.cause is not None:
            self.last_failure = outcome

    @property
    def exceeded(self) -> bool:
        """Only once the window is full: a few failures at the start say nothing."""
        full = len(self._recent) == self._recent.maxlen
        return full and sum(self._recent) > self.limit * len(self._recent)

    def message(self) -> str:
        last = self.last_failure
        share = sum(self._recent) / max(len(self._recent), 1)
        return (
            f"{share:.0%} of the last {len(self._recent)} episodes failed (limit {self.limit:.0%}); "
            f"the last: {last.cause}: {last.detail}"
        )


@dataclasses.dataclass
class EpisodeStats:
    """One report interval's figures; a new one starts each interval."""

    since: float = dataclasses.field(default_factory=time.perf_counter)
    episodes: int = 0
    failures: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tool_failures: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    turns: list[int] = dataclasses.field(default_factory=list)
    env_seconds: list[float] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    tokens: int = 0
    groups: int = 0
    groups_failed: int = 0
    prompts_too_long: int = 0

    def episode(self, ctx: Context, outcome: Outcome) -> None:
        self.episodes += 1
        self.turns.append(ctx.turns)
        self.env_seconds += ctx.env_seconds
        self.tool_failures.update(ctx.tool_failures)
        self.tokens += sum(ctx.mask)
        if outcome.cause is not None:
            self.failures[outcome.cause] += 1
        else:
            self.rewards.append(outcome.reward)

    def record(self, in_flight: int, idle_fraction: float | None) -> dict:
        """The interval's metrics."""
        seconds = max(time.perf_counter() - self.since, 1e-9)
        record = {
            "generator/tokens_per_s": self.tokens / seconds,
            "generator/groups": self.groups,
            "generator/prompts_too_long": self.prompts_too_long,
            "episodes/in_flight": in_flight,
            "episodes/done": self.episodes,
            "episodes/failed": sum(self.failures.values()),
            "episodes/groups_failed": self.groups_failed,
            **{f"episodes/failed_{cause}": n for cause, n in sorted(self.failures.items())},
            **{f"tools/{cause}": n for cause, n in sorted(self.tool_failures.items())},
        }
        if self.rewards:
            record["generator/reward_mean"] = float(np.mean(self.rewards))
        if self.turns:
            record["episodes/turns_mean"] = float(np.mean(self.turns))
        if self.env_seconds:
            record["episodes/env_seconds_per_step"] = float(np.mean(self.env_seconds))
        if idle_fraction is not None:
            record["engine/idle_fraction"] = idle_fraction
        return record
