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


@pytest.mark.redis
def test_the_largest_difference_of_any_generator_is_kept_per_version(control):
    assert probe.read_health(control) == {"probe_logprob_diff_max": None, "versions": {}}
    for version in (1, 2):
        probe.publish(control, version, LEARNER)
    assert probe.difference(control, 1, [-1.0, -2.25, -0.5]) == 0.25  # generator A
    assert probe.difference(control, 1, [-1.0, -2.0, -0.5]) == 0.0  # generator B, later: A's stays
    assert probe.difference(control, 2, [-1.125, -2.0, -0.5]) == 0.125
    assert probe.difference(control, 7, LEARNER) is None  # no probe of version 7: nothing kept
    assert probe.read_health(control) == {"probe_logprob_diff_max": 0.25, "versions": {"1": 0.25, "2": 0.125}}
    for version in range(3, 3 + probe.KEEP_VERSIONS):  # versions 1 and 2 age out with their probes
        probe.publish(control, version, LEARNER)
    assert probe.read_health(control) == {"probe_logprob_diff_max": None, "versions": {}}


@pytest.mark.redis
def test_a_non_finite_difference_is_never_hidden(control):
    probe.publish(control, 1, LEARNER)
    assert math.isnan(probe.difference(control, 1, [math.nan, -2.0, -0.5]))
    assert probe.difference(control, 1, LEARNER) == 0.0
    assert math.isnan(probe.read_health(control)["probe_logprob_diff_max"])


@pytest.mark.redis
def test_status_shows_the_sync_figure(redis_server, control):
    buf = RedisBuffer(redis_server.url, control.keys.prefix)
    try:
        buf.set_version(3)
    finally:
        buf.close()
    console = Console(record=True, width=200)
    render(status(redis_url=redis_server.url, prefix=control.keys.prefix), console)
    assert "weight sync (probe): no generator has compared a version yet" in console.export_text()
    for version in (2, 3):
        probe.publish(control, version, LEARNER)
        probe.difference(control, version, [-1.0, -2.0, -0.5 + version / 1000])
    st = status(redis_url=redis_server.url, prefix=control.keys.prefix)
    assert st["weight_sync"] == {"probe_logprob_diff_max": 0.003, "versions": {"2": 0.002, "3": 0.003}}
    console = Console(record=True, width=200)
    render(st, console)
    text = console.export_text()
    assert "weight sync (probe): largest |generator - learner| log-prob 0.003 at versions 2-3" in text
    assert "probe:" not in text and "probe_diff" not in text
