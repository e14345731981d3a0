"""What a generator counts about its episodes: the failure limit and the metrics of each report.

``FailureWindow`` is the run's failure limit: among a generator's last ``episode.failure_window``
episodes, more than ``episode.failure_limit`` failed means something is broken (a reward that always
raises, an environment server that is down), and the run stops with one clear error instead of
training on nothing. ``EpisodeStats`` collects one report's figures (episodes, failures by cause,
turns, environment seconds, tokens) and turns them into namespaced metrics.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time

import numpy as np

from asyncrl.episodes.api import Context, Outcome
from asyncrl.observe.lengths import bin_of


class FailureWindow:
    """More than ``limit`` x ``window`` failed among a generator's last ``window`` episodes.

    Calibrated for how failures arrive. Whole groups end at once (a group is counted when its last
    episode ends, so an episode that fails fast is never counted ahead of its siblings that succeed
    slowly), and failures often come in whole groups (a prompt that breaks the environment breaks all
    its samples), so the window must span many groups for the share to mean anything: the default
    (400 episodes, 50 groups of 8) puts a run whose groups fail at random at 20% more than five
    standard deviations under a limit of 50%, while one at 70% stops within about 290 episodes.
    The count is absolute: before the window is full, the run stops as soon as more episodes failed
    than a full window may hold, so a few failures at the start never stop it and a reward that always
    raises stops it after ``limit x window`` episodes, not after a full window.
    """

    def __init__(self, window: int, limit: float):
        self.window, self.limit = window, limit
        self._groups: collections.deque[tuple[int, int]] = collections.deque()  # (episodes, failed)
        self._episodes = self._failed = 0
        self.last_failure: Outcome | None = None

    def add_group(self, outcomes: list[Outcome]) -> None:
        failed = [o for o in outcomes if o.cause is not None]
        if failed:
            self.last_failure = failed[-1]
        self._groups.append((len(outcomes), len(failed)))
        self._episodes += len(outcomes)
        self._failed += len(failed)
        while self._groups and self._episodes - self._groups[0][0] >= self.window:
            n, f = self._groups.popleft()  # keep at least `window` episodes: whole groups, the oldest out
            self._episodes -= n
            self._failed -= f

    @property
    def share(self) -> float:
        return self._failed / max(self._episodes, 1)

    @property
    def exceeded(self) -> bool:
        return self._failed > self.limit * max(self.window, self._episodes)

    def message(self) -> str:
        last = self.last_failure
        return (
            f"{self._failed} of the last {self._episodes} episodes failed ({self.share:.0%}, limit "
            f"{self.limit:.0%} of {self.window}); the last: {last.cause}: {last.detail}"
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
    lengths: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # samples by bin
    groups: int = 0
    groups_failed: int = 0
    groups_resumed: int = 0  # taken over from a generator that died (generators.journal)
    turns_resumed: int = 0  # their model turns kept from the journal, not played again
    prompts_too_long: int = 0

    def episode(self, ctx: Context, outcome: Outcome) -> None:
        self.episodes += 1
        self.turns.append(ctx.turns)
        self.env_seconds += ctx.env_seconds
        self.tool_failures.update(ctx.tool_failures)
        self.tokens += sum(ctx.mask)
        self.lengths[bin_of(sum(ctx.mask))] += 1
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
            "episodes/model_tokens": self.tokens,  # generated: what the learners train on (learner/tokens) and drop
            "episodes/model_tokens_hist": dict(self.lengths),  # by bin of asyncrl.observe.lengths
            "episodes/failed": sum(self.failures.values()),
            "episodes/groups_failed": self.groups_failed,
            "episodes/groups_resumed": self.groups_resumed,
            "episodes/turns_resumed": self.turns_resumed,
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


def threads_and_children() -> tuple[int, int]:
    """This process's OS threads (Python's and native ones alike) and its live child processes: what
    user code may never grow without bound (``generator/threads``, ``generator/child_processes``). The
    children are read from each thread's ``/proc/self/task/<tid>/children`` (a child is listed under the
    thread that started it); a scan of every process's ``/proc/<pid>/stat`` took ~2 ms of the event loop,
    and is what a kernel without those files gets."""
    tasks = list(os.scandir("/proc/self/task"))
    pids: list[str] = []
    for task in tasks:
        try:
            with open(f"{task.path}/children") as f:
                pids += f.read().split()
        except FileNotFoundError:
            if not os.path.exists(f"/proc/self/task/{os.getpid()}/children"):  # not in this kernel
                return len(tasks), sum(1 for _ in children_by_scan())
        except OSError:  # the thread ended meanwhile
            continue
    return len(tasks), sum(_live(pid) for pid in pids)


def _live(pid: str) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _stat(pid: str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command (which may hold spaces): state, parent, ...; None
    when the process ended meanwhile."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children_by_scan():
    """This process's live children, from every process's ``/proc/<pid>/stat`` (its parent, its state)."""
    me = str(os.getpid())
    for entry in os.scandir("/proc"):
        fields = _stat(entry.name) if entry.name.isdigit() else None
        if fields is not None and fields[0] != "Z" and fields[1] == me:
            yield int(entry.name)
