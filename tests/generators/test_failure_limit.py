"""The failure limit's calibration (``generators.accounting.FailureWindow`` at the config's defaults):
runs whose episodes fail at random at 20% never trip it, however the failures are grouped; runs at 70%
trip it within a few hundred episodes. Seeded simulations of long runs, groups of 8 as the demos use."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.config import CompletionEpisodeConfig
from asyncrl.episodes.api import Outcome
from asyncrl.generators.accounting import FailureWindow

DEFAULTS = CompletionEpisodeConfig()
GROUP = 8
OK, FAILED = Outcome({"reward": 1.0}), Outcome(None, "env_error", "broke")


def groups(share: float, whole_groups: bool, n_groups: int, seed: int):
    """Each group's outcomes: every episode failing at random with ``share``, or (``whole_groups``:
    a prompt that breaks every sample) whole groups failing with ``share``."""
    rng = np.random.default_rng(seed)
    for _ in range(n_groups):
        if whole_groups:
            yield [FAILED if rng.random() < share else OK] * GROUP
        else:
            yield [FAILED if rng.random() < share else OK for _ in range(GROUP)]


def episodes_until_tripped(share: float, whole_groups: bool, n_groups: int, seed: int) -> int | None:
    window = FailureWindow(DEFAULTS.failure_window, DEFAULTS.failure_limit)
    for i, outcomes in enumerate(groups(share, whole_groups, n_groups, seed)):
        window.add_group(outcomes)
        if window.exceeded:
            return (i + 1) * GROUP
    return None


@pytest.mark.parametrize("whole_groups", [False, True], ids=["episodes", "whole-groups"])
@pytest.mark.parametrize("seed", range(5))
def test_a_run_failing_at_random_at_20_percent_never_trips_the_limit(whole_groups, seed):
    assert episodes_until_tripped(0.2, whole_groups, n_groups=5000, seed=seed) is None


@pytest.mark.parametrize("whole_groups", [False, True], ids=["episodes", "whole-groups"])
@pytest.mark.parametrize("seed", range(5))
def test_a_run_failing_at_random_at_70_percent_stops_within_a_few_hundred_episodes(whole_groups, seed):
    tripped = episodes_until_tripped(0.7, whole_groups, n_groups=5000, seed=seed)
    assert tripped is not None and tripped <= 400, tripped


def test_a_run_where_everything_fails_stops_once_more_than_limit_x_window_failed():
    window = FailureWindow(100, 0.5)
    for _ in range(6):  # 48 failed: not yet more than 50
        window.add_group([FAILED] * GROUP)
    assert not window.exceeded
    window.add_group([FAILED] * GROUP)  # 56
    assert window.exceeded
    assert window.message().startswith("56 of the last 56 episodes failed") and "env_error: broke" in window.message()


def test_early_failures_say_nothing_and_old_groups_leave_the_window_whole():
    window = FailureWindow(100, 0.5)
    for _ in range(3):
        window.add_group([FAILED] * GROUP)
    assert not window.exceeded  # 24 of 24 failed, but a full window may hold 50
    for _ in range(20):
        window.add_group([OK] * GROUP)
    assert window.share == 0.0  # the failed groups left: the window keeps the last >= 100 episodes
    window.add_group([FAILED, OK, OK, OK])  # groups of any size
    assert 100 <= window._episodes < 100 + GROUP and window._failed == 1
