"""``weights/sync_seconds``: learner step end to every live generator serving that version."""

from __future__ import annotations

import pytest

from asyncrl.run.stats import WeightSync


def step(version: int, end: float) -> dict:
    return {"source": "learner/0", "time": end + 0.1, "learner/version": version, "time/step_end_at": end}


def applied(gen: int, version: int, at: float, held: float = 0.0) -> dict:
    return {"source": f"generator/{gen}", "time": at, "generator/version": version, "weights/applied_at": at,
            "weights/held_seconds": held}  # fmt: skip


def test_waits_for_every_live_generator_and_counts_skipped_versions() -> None:
    sync = WeightSync(live_s=30)
    assert sync.fold(applied(0, 0, 0.0)) == []
    assert sync.fold(applied(1, 0, 0.0)) == []
    assert sync.fold(step(1, 10.0)) == []
    assert sync.fold(applied(0, 1, 10.5)) == []  # generator 1 does not serve 1 yet
    assert sync.fold(step(2, 11.0)) == []
    # generator 1 skips version 1 (newest wins): serving 2 covers both
    out = sync.fold(applied(1, 2, 11.25))
    assert out == [{"weights/version": 1, "weights/sync_seconds": 1.25, "weights/sync_held_seconds": 0.0}]
    out = sync.fold(applied(0, 2, 11.5))
    assert out == [{"weights/version": 2, "weights/sync_seconds": 0.5, "weights/sync_held_seconds": 0.0}]


def test_a_dead_generator_does_not_hold_the_figure_back() -> None:
    sync = WeightSync(live_s=5)
    sync.fold(applied(0, 0, 0.0))
    sync.fold(applied(1, 0, 0.0))
    sync.fold(step(1, 10.0))
    out = sync.fold(applied(0, 1, 10.2))  # generator 1 silent for 10 s: gone
    assert [r["weights/version"] for r in out] == [1]
    assert out[0]["weights/sync_seconds"] == pytest.approx(0.2)


def test_a_version_made_again_after_a_learner_restart_is_measured_again() -> None:
    sync = WeightSync()
    sync.fold(applied(0, 0, 0.0))
    sync.fold(step(1, 1.0))
    assert len(sync.fold(applied(0, 1, 1.5))) == 1
    sync.fold(step(1, 5.0))  # restarted from version 0
    assert sync.fold(applied(0, 1, 5.25))[0]["weights/sync_seconds"] == 0.25


def test_the_wait_for_an_evaluation_is_the_last_generators_own() -> None:
    """At an eval point the generator that evaluates serves the version last: its wait is the figure's."""
    sync = WeightSync()
    sync.fold(applied(0, 0, 0.0))
    sync.fold(applied(1, 0, 0.0))
    sync.fold(step(1, 10.0))
    assert sync.fold(applied(0, 1, 10.1)) == []
    (out,) = sync.fold(applied(1, 1, 11.5, held=1.3))  # it evaluated version 0 meanwhile
    assert out["weights/sync_seconds"] == pytest.approx(1.5) and out["weights/sync_held_seconds"] == 1.3


def test_a_wait_that_began_before_the_step_ended_counts_only_after_it() -> None:
    sync = WeightSync()
    sync.fold(applied(0, 0, 0.0))
    sync.fold(step(1, 10.0))
    (out,) = sync.fold(applied(0, 1, 10.5, held=2.0))  # held since 8.5, under version 0's evaluation
    assert out["weights/sync_held_seconds"] == pytest.approx(0.5) == out["weights/sync_seconds"]
