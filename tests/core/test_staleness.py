"""Property tests of the staleness bound and admission control (``asyncrl/staleness.py``).

The simulations below play generators, a learner and the admission rule against each other under
schedules hypothesis chooses, and check the two promises the rules make:

* in-order consumption: no trajectory is ever staler than ``k`` (AReaL's argument);
* any order, with the learner's staleness filter giving dropped slots back: nothing stale is
  trained on, and the system never deadlocks (someone can always make progress).
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.staleness import (
    admission_limit,
    claim_share,
    is_fresh,
    may_start_group,
    staleness,
    trajectory_version,
)

versions = st.integers(0, 1_000)
lags = st.integers(0, 8)
group_sizes = st.integers(1, 16)


# ----- the pure functions -----------------------------------------------------------------------


@given(st.lists(versions, min_size=1, max_size=50))
def test_trajectory_version_is_the_oldest_token_version(token_versions) -> None:
    v = trajectory_version(token_versions)
    assert v == min(token_versions)
    assert trajectory_version(token_versions + [v + 1]) == v  # newer tokens never make it fresher
    assert trajectory_version(sorted(token_versions, reverse=True)) == v


@given(versions, versions, lags)
def test_fresh_iff_staleness_within_lag(learner_v, traj_v, k) -> None:
    assert staleness(learner_v, traj_v) == learner_v - traj_v
    assert is_fresh(learner_v, traj_v, k) == (0 <= learner_v - traj_v <= k)
    assert is_fresh(traj_v, traj_v, k)  # a trajectory of the current version is always usable


@given(versions, versions, lags)
def test_freshness_is_monotone(learner_v, traj_v, k) -> None:
    assert not is_fresh(traj_v, traj_v + 1, k)  # newer than the learner: from a discarded policy
    if is_fresh(learner_v, traj_v, k):
        if traj_v < learner_v:
            assert is_fresh(learner_v, traj_v + 1, k)  # a newer trajectory is fresh too
            assert is_fresh(learner_v - 1, traj_v, k)  # an earlier learner step too
        assert is_fresh(learner_v, traj_v, k + 1)  # a looser bound accepts it too


@given(versions, lags, group_sizes)
def test_admission_limit_is_monotone_and_steps_by_b(v, k, b) -> None:
    limit = admission_limit(v, k, b)
    assert limit == (v + k + 1) * b
    assert admission_limit(v + 1, k, b) == limit + b  # each new version opens exactly B slots
    assert admission_limit(v, k + 1, b) == limit + b
    assert admission_limit(v, k, b + 1) > limit


@given(versions, st.integers(0, 20_000), lags, group_sizes)
def test_may_start_group_is_monotone(v, live, k, b) -> None:
    allowed = may_start_group(v, live, k, b)
    assert allowed == (live < admission_limit(v, k, b))
    if allowed:
        assert may_start_group(v + 1, live, k, b)  # newer weights never block a start
        assert may_start_group(v, live, k + 1, b)
        if live > 0:
            assert may_start_group(v, live - 1, k, b)  # fewer live groups never block a start
    else:
        assert not may_start_group(v, live + 1, k, b)


@given(versions, group_sizes)
def test_k0_is_lockstep(v, b) -> None:
    """k = 0: a generator serving v may start exactly the B groups of step v, after all earlier ones."""
    assert may_start_group(v, (v + 1) * b - 1, 0, b)
    assert not may_start_group(v, (v + 1) * b, 0, b)
    assert not may_start_group(v - 1, v * b, 0, b) if v > 0 else True


# ----- simulations ------------------------------------------------------------------------------


@dataclasses.dataclass
class Group:
    seq: int
    version: int  # the serving version when it started: the oldest version among its tokens
    done: bool = False


@dataclasses.dataclass
class World:
    k: int
    b: int
    n_gen: int
    learner_v: int = 0
    started: int = 0
    dropped: int = 0
    consumed: int = 0  # groups taken by the learner (trained or dropped)
    serving: list[int] = dataclasses.field(default_factory=list)
    groups: list[Group] = dataclasses.field(default_factory=list)
    trained_staleness: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.serving = [0] * self.n_gen

    def try_start(self, g: int) -> bool:
        if not may_start_group(self.serving[g], self.started - self.dropped, self.k, self.b):
            return False
        self.groups.append(Group(self.started, self.serving[g]))
        self.started += 1
        return True

    def update_weights(self, g: int, to: int) -> None:
        """Generators apply versions late but never go back, and never see one not yet published."""
        self.serving[g] = max(self.serving[g], min(to, self.learner_v))


# A schedule of actions (kind, generator or group index, argument). min_size: hypothesis favours
# short lists, and a lag violation needs a few starts and steps in a row.
actions = st.lists(
    st.tuples(st.sampled_from(["start", "update", "finish", "learn"]), st.integers(0, 7), st.integers(0, 50)),
    min_size=10,
    max_size=100,
)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 3), st.integers(1, 4), st.integers(1, 4), actions)
def test_in_order_consumption_never_exceeds_the_lag(k, b, n_gen, schedule) -> None:
    """Generators obey admission and update weights whenever they like; the learner trains on the
    next B groups in start order (when they finish does not matter then: a group's version is fixed
    when it starts). Every trained group has staleness <= k."""
    w = World(k, b, n_gen)
    for kind, i, arg in schedule:
        if kind == "start":
            w.try_start(i % n_gen)
        elif kind == "update":
            w.update_weights(i % n_gen, arg)
        elif kind == "learn" and w.started - w.consumed >= b:
            batch = w.groups[w.consumed : w.consumed + b]
            w.trained_staleness += [staleness(w.learner_v, g.version) for g in batch]
            w.consumed += b
            w.learner_v += 1
    assert all(s <= k for s in w.trained_staleness), w.trained_staleness


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 3), st.integers(1, 4), st.integers(1, 4), actions)
def test_out_of_order_with_filter_is_safe_and_live(k, b, n_gen, schedule) -> None:
    """Groups finish in any order and the learner consumes them in arrival order, dropping stale
    ones and giving their slots back. Nothing stale is trained on; and whenever the learner is
    short of groups, a generator that has caught up with the learner may start one (no deadlock)."""
    w = World(k, b, n_gen)
    arrived: list[Group] = []
    batch: list[Group] = []
    for kind, i, arg in schedule:
        if kind == "start":
            w.try_start(i % n_gen)
        elif kind == "update":
            w.update_weights(i % n_gen, arg)
        elif kind == "finish":
            running = [g for g in w.groups if not g.done]
            if running:
                g = running[i % len(running)]
                g.done = True
                arrived.append(g)
        elif kind == "learn" and arrived:
            g = arrived.pop(0)  # the learner's staleness filter, at consumption
            if is_fresh(w.learner_v, g.version, k):
                batch.append(g)
            else:
                w.dropped += 1
            if len(batch) == b:
                w.trained_staleness += [staleness(w.learner_v, x.version) for x in batch]
                w.learner_v += 1
                batch = []
        # Liveness: groups in flight + arrived + batched cannot fill the next step, so the learner
        # waits; then a generator serving the learner's version must be admitted.
        live = w.started - w.dropped - len(w.trained_staleness)
        if live < b:
            assert may_start_group(w.learner_v, w.started - w.dropped, k, b)
    assert all(s <= k for s in w.trained_staleness)


def test_out_of_order_arrival_can_exceed_the_lag_without_the_filter() -> None:
    """Why the learner filters: admission alone bounds staleness only for in-order consumption.
    k = 1, B = 1: group 0 starts at version 0 and arrives after later groups were trained on."""
    w = World(k=1, b=1, n_gen=2)
    assert w.try_start(0)  # slow group, version 0
    for _ in range(3):
        assert w.try_start(1)  # fast generator keeps up with the learner
        w.learner_v += 1  # its group trains the next step
        w.update_weights(1, w.learner_v)
    slow = w.groups[0]
    assert staleness(w.learner_v, slow.version) == 3 > w.k
    assert not is_fresh(w.learner_v, slow.version, w.k)


@given(lags, group_sizes, st.integers(1, 30))
def test_sync_mode_falls_out_of_the_same_rule(k, b, steps) -> None:
    """Generators always serving the newest weights: total admitted before step v = (v + k + 1) B."""
    started = 0
    for v in range(steps):
        while may_start_group(v, started, k, b):
            started += 1
        assert started == admission_limit(v, k, b)


@given(st.integers(-50, 500), st.integers(1, 16), st.integers(1, 64), st.integers(1, 64))
def test_claim_share_is_bounded_by_what_is_open_and_the_cap(open_slots, generators, cap, per_step) -> None:
    share = claim_share(open_slots, generators, cap, per_step)
    if open_slots <= 0:
        assert share == 0
        return
    assert 1 <= share <= min(cap, open_slots)
    # every generator taking its share covers what is open (unless capped)
    assert share * generators >= min(open_slots, cap * generators)


@given(st.integers(1, 8), st.integers(1, 8), st.integers(0, 50))
def test_claim_share_in_sync_mode_gives_equal_batches(generators, per_generator, version) -> None:
    """k = 0: the generators arriving one after another each get ceil(B / G) groups, never crumbs."""
    b = generators * per_generator
    live, shares = version * b, []
    for _ in range(generators):
        share = claim_share(admission_limit(version, 0, b) - live, generators, 64, b)
        shares.append(share)
        live += share
    assert shares == [per_generator] * generators
