"""The two invariants of asynchronous training, as pure functions.

Policy version ``v`` counts learner optimizer steps (initial weights are version 0). A trajectory's
version is the OLDEST version among its tokens. ``max_policy_lag = k`` bounds how old a trajectory
may be when the learner consumes it, and admission control keeps generators from starting work
that could only arrive stale. The Redis buffer applies the same rules atomically in Lua
(``buffers/redis_buffer.py``, installed as ``asyncrl.buffers.redis_buffer``); the property tests in
``tests/core/test_staleness.py`` pin both.
"""

from __future__ import annotations


def trajectory_version(token_versions) -> int:
    """The version a trajectory counts as: the oldest policy that produced any of its tokens."""
    return int(min(token_versions))


def staleness(learner_version: int, traj_version: int) -> int:
    """How many optimizer steps the learner is ahead of the policy that produced a trajectory."""
    return learner_version - traj_version


def is_fresh(learner_version: int, traj_version: int, max_policy_lag: int) -> bool:
    """The staleness bound: the step that starts at ``learner_version`` may use this trajectory.

    ``0 <= staleness <= k``. A trajectory NEWER than the learner (staleness < 0) can only come from a
    policy that a learner restart discarded (the restart went back to an older checkpoint): it is not
    fresh either, it describes weights that no longer exist.
    """
    return 0 <= staleness(learner_version, traj_version) <= max_policy_lag


def admission_limit(serving_version: int, max_policy_lag: int, groups_per_step: int) -> int:
    """How many groups may have been started in total while a generator serves ``serving_version``.

    AReaL's rule: ``(g + k + 1) * B``. A group started under this bound is consumed, in order, by a
    learner step at version ``<= g + k``, so it arrives within the lag bound. With ``k = 0``
    generators wait for fresh weights after every ``B`` groups: the synchronous loop.
    """
    return (serving_version + max_policy_lag + 1) * groups_per_step


def may_start_group(serving_version: int, live_started: int, max_policy_lag: int, groups_per_step: int) -> bool:
    """Admission control. ``live_started`` counts groups holding a slot (``buffers.base.live_groups``):

    started and replayed, minus those that never reach a gradient (dropped as stale, filtered, dead,
    abandoned), which give their slot back, or a learner that needs fresh groups could wait forever.
    """
    return live_started < admission_limit(serving_version, max_policy_lag, groups_per_step)


def claim_share(open_slots: int, generators: int, groups_in_flight: int, groups_per_step: int) -> int:
    """How many groups one generator claims for its next engine call.

    At least its share of a step (``ceil(B / G)``), so that with ``k = 0`` the ``B`` groups of a
    step go to the generators in equal batches instead of fragmenting as each arrives (8 open, two
    generators: 4 and 4, not 4, 2, 1, 1), and its share of whatever else is open, so with ``k > 0``
    engine calls get bigger batches (one of the ways bounded asynchrony pays); never more than
    ``groups_in_flight`` or than is open.
    """
    if open_slots <= 0:
        return 0
    g = max(1, generators)
    fair = max(-(-groups_per_step // g), -(-open_slots // g))
    return min(groups_in_flight, open_slots, fair)
