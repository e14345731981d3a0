"""The weight-sync probe as the run's sync-health figure, against a real redis-server: every generator's
difference at a version is kept (the largest, whichever generator wrote last), old versions go with
their probes, a non-finite difference is never hidden by a later finite one, and ``asyncrl status``
shows the figure (``--json``: ``weight_sync``)."""

from __future__ import annotations

import math
import uuid

import pytest
from rich.console import Console

from asyncrl.buffers import run_prefix
from asyncrl.buffers.redis_buffer import RedisBuffer
from asyncrl.control import RunControl, connect
from asyncrl.observe import probe
from asyncrl.observe.status import render, status

LEARNER = [-1.0, -2.0, -0.5]


@pytest.fixture
def control(redis_server):
    c = RunControl(connect(redis_server.url), run_prefix(f"probe-{uuid.uuid4().hex[:8]}"))
    yield c
    c.r.close()


def set_version(redis_server, control, version: int) -> None:
    """The run's policy version, as the learner sets it (status finds a run by it)."""
    buf = RedisBuffer(redis_server.url, control.keys.prefix)
    try:
        buf.set_version(version)
    finally:
        buf.close()


@pytest.mark.redis
def test_the_largest_difference_of_any_generator_is_kept_per_version(control):
    assert probe.read_health(control) == {
        "probe_logprob_diff_max": None,
        "versions": {},
        "probe_routing_diff_max": None,
    }
    for version in (1, 2):
        probe.publish(control, version, LEARNER)
    assert probe.difference(control, 1, [-1.0, -2.25, -0.5]) == 0.25  # generator A
    assert probe.difference(control, 1, [-1.0, -2.0, -0.5]) == 0.0  # generator B, later: A's stays
    assert probe.difference(control, 2, [-1.125, -2.0, -0.5]) == 0.125
    assert probe.difference(control, 7, LEARNER) is None  # no probe of version 7: nothing kept
    health = probe.read_health(control)
    assert health == {
        "probe_logprob_diff_max": 0.25,
        "versions": {"1": 0.25, "2": 0.125},
        "probe_routing_diff_max": None,
    }
    for version in range(3, 3 + probe.KEEP_VERSIONS):  # versions 1 and 2 age out with their probes
        probe.publish(control, version, LEARNER)
    assert probe.read_health(control)["versions"] == {}


@pytest.mark.redis
def test_a_non_finite_difference_is_never_hidden(control):
    probe.publish(control, 1, LEARNER)
    assert math.isnan(probe.difference(control, 1, [math.nan, -2.0, -0.5]))
    assert probe.difference(control, 1, LEARNER) == 0.0
    assert math.isnan(probe.read_health(control)["probe_logprob_diff_max"])


@pytest.mark.redis
def test_status_shows_the_sync_figure(redis_server, control):
    set_version(redis_server, control, 3)
    console = Console(record=True, width=200)
    render(status(redis_url=redis_server.url, prefix=control.keys.prefix), console)
    assert "weight sync (probe): no generator has compared a version yet" in console.export_text()
    for version in (2, 3):
        probe.publish(control, version, LEARNER)
        probe.difference(control, version, [-1.0, -2.0, -0.5 + version / 1000])
    st = status(redis_url=redis_server.url, prefix=control.keys.prefix)
    assert st["weight_sync"] == {
        "probe_logprob_diff_max": 0.003,
        "versions": {"2": 0.002, "3": 0.003},
        "probe_routing_diff_max": None,  # a dense model
    }
    console = Console(record=True, width=200)
    render(st, console)
    text = console.export_text()
    assert "weight sync (probe): largest |generator - learner| log-prob 0.003 at versions 2-3" in text
    assert "probe:" not in text and "probe_diff" not in text


@pytest.mark.redis
def test_a_mixture_of_experts_record_compares_the_expert_choices_too(control):
    """The learner publishes its expert choices of the probe with each version (per layer, per token, sorted);
    a generator's record has the fraction of (layer, token) whose choices differ from its engine's."""
    learner = [[[0, 3], [1, 2], [2, 5]], [[4, 7], [0, 1], [3, 6]]]
    probe.publish(control, 1, LEARNER, learner)
    assert probe.compare(control, 1, LEARNER, learner) == {
        "weights/probe_logprob_diff": 0.0,
        "weights/probe_routing_diff": 0.0,
    }
    engine = [[[0, 3], [1, 4], [2, 5]], [[4, 7], [0, 1], [3, 5]]]  # two of six (layer, token) differ
    assert probe.compare(control, 1, LEARNER, engine)["weights/probe_routing_diff"] == pytest.approx(2 / 6)
    # the largest any generator found at a kept version, for the learner's step record
    assert probe.read_health(control)["probe_routing_diff_max"] == pytest.approx(2 / 6)
    assert "weights/probe_routing_diff" not in probe.compare(control, 1, LEARNER)  # a dense engine: no routing
    probe.publish(control, 2, LEARNER)  # a dense learner: nothing to compare the engine's choices with
    assert probe.compare(control, 2, LEARNER, engine) == {"weights/probe_logprob_diff": 0.0}
    assert probe.compare(control, 9, LEARNER, engine) == {}  # the learner's probe is gone
    with pytest.raises(ValueError, match="tokens per layer"):
        probe.routing_difference(learner, [layer[:2] for layer in engine])
    for version in range(3, 3 + probe.KEEP_VERSIONS):  # old routing goes with its probe
        probe.publish(control, version, LEARNER, learner)
    assert control.get_meta(f"{probe.ROUTING_PREFIX}1") is None
    assert probe.read_health(control)["probe_routing_diff_max"] is None  # version 1's difference went with it
    assert probe.is_probe_field(f"{probe.ROUTING_PREFIX}3") and not probe.is_probe_field("probe_routing:x")


# ----- sampled sequences, the mismatch's figures, and a sync told from the numerics gap ---------------------


def test_figures_measure_the_gap_by_quarter_and_as_a_sequence_kl():
    learner = [-1.0, -2.0, -0.5, -3.0, -1.0, -1.0, -2.0, -0.25]
    engine = [-1.0, -2.5, -0.5, -3.0, -1.0, -0.75, -2.0, -0.25]
    fig = probe.figures(learner, engine, None, 3)
    assert fig["weights/probe_logprob_diff"] == 0.5
    assert fig["weights/probe_logprob_diff_mean"] == pytest.approx(0.75 / 8)
    assert [fig[f"weights/probe_logprob_diff_q{q}"] for q in (1, 2, 3, 4)] == [0.25, 0.0, 0.125, 0.0]
    assert fig["weights/probe_kl"] == pytest.approx(math.expm1(0.5) - 0.5 + math.expm1(-0.25) + 0.25)
    assert "weights/probe_version_fraction" not in fig  # no previous version to place the engine against
    with pytest.raises(ValueError, match="3 log-probs, the learner's has 8"):
        probe.figures(learner, engine[:3], None, 3)


def test_the_placement_puts_the_engine_between_two_versions_or_says_nothing():
    previous = [-1.0, -2.0, -0.5, -3.0, -1.0, -2.0]
    new = [-1.5, -1.0, -0.5, -2.0, -1.0, -2.5]  # the step moved five tokens by 0.5-1.0
    noise = [0.01, -0.02, 0.015, -0.01, 0.02, 0.005]  # a numerics gap far below the move
    engine_new = [n + e for n, e in zip(new, noise, strict=True)]
    engine_old = [p + e for p, e in zip(previous, noise, strict=True)]
    engine_half = [(p + n) / 2 + e for p, n, e in zip(previous, new, noise, strict=True)]
    t, missed = probe.placement(previous, new, engine_new)
    assert t == pytest.approx(1.0, abs=0.03) and missed < probe.MISSED
    t, missed = probe.placement(previous, new, engine_old)
    assert t == pytest.approx(0.0, abs=0.03) and missed > 10 * probe.MISSED
    t, missed = probe.placement(previous, new, engine_half)
    assert t == pytest.approx(0.5, abs=0.03) and missed > probe.MISSED
    # a step smaller than the gap: the two versions cannot be told apart, and nothing is claimed
    tiny = [p + 0.001 for p in previous]
    assert probe.placement(previous, tiny, engine_old) is None
    assert probe.placement(previous, previous, engine_old) is None  # nothing moved
    assert probe.placement(previous, new, engine_new[:3]) is None


@pytest.mark.redis
def test_a_sampled_probe_travels_with_its_ids_and_a_broken_sync_is_said_and_kept(control, caplog):
    previous, new = [-1.0, -2.0, -0.5, -3.0], [-1.5, -1.0, -0.5, -2.0]
    probe.publish(control, 4, new, ids=[7, 8, 9, 10, 11], previous=previous)
    probe.publish(control, 5, new)  # the fixed probe: no ids
    assert probe.ids_of(control, 4) == [7, 8, 9, 10, 11] and probe.ids_of(control, 5) is None
    healthy = probe.compare(control, 4, [x + e for x, e in zip(new, [0.01, -0.02, 0.015, -0.01], strict=True)])
    assert healthy["weights/probe_version_fraction"] == pytest.approx(1.0, abs=0.05)
    assert "broken" not in probe.read_health(control) and not caplog.records
    stale = probe.compare(control, 4, [x + e for x, e in zip(previous, [0.01, -0.02, 0.015, -0.01], strict=True)])
    assert stale["weights/probe_version_fraction"] == pytest.approx(0.0, abs=0.02)  # another generator: the one before
    assert probe.read_health(control)["broken"] == {
        "4": pytest.approx(stale["weights/probe_version_fraction"], abs=1e-4)
    }
    missed = stale["weights/probe_sync_missed"]
    assert [r.getMessage() for r in caplog.records] == [
        "weight sync of version 4 is broken or stale: the engine's log-probs of the probe sit -0.02 of the way "
        f"from version 3 to 4 (1: the version applied): it misses {missed:.3g} times what the numerics gap of its "
        "dtype explains"
    ]
    assert probe.is_probe_field(probe.broken_field(4))


@pytest.mark.redis
def test_status_says_which_versions_a_generator_found_broken(redis_server, control):
    set_version(redis_server, control, 7)
    previous, new = [-1.0, -2.0, -0.5, -3.0], [-1.5, -1.0, -0.5, -2.0]
    for version in (6, 7):
        probe.publish(control, version, new, ids=[1, 2, 3, 4, 5], previous=previous)
    probe.compare(control, 6, new)  # healthy
    probe.compare(control, 7, [p + 0.25 * (n - p) for p, n in zip(previous, new, strict=True)])  # a quarter applied
    st = status(redis_url=redis_server.url, prefix=control.keys.prefix)
    assert st["weight_sync"]["broken"] == {"7": pytest.approx(0.25)}
    console = Console(record=True, width=200)
    render(st, console)
    text = console.export_text()
    assert (
        "weight sync broken or stale at versions 7: an engine's log-probs sit 0.25 of the way from version 6 to 7"
        in (text)
    )
