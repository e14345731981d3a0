"""The generator's lease keeper (generators/lease.py): it renews between the loop's ticks while the loop
ticks, stops renewing once the loop stalls (so a stuck generator still loses its lease), reports a lost
lease, and stops at close; against a real redis-server, a lease kept alive past its life by the keeper alone."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from asyncrl.buffers import run_prefix
from asyncrl.control import RunControl, connect
from asyncrl.generators.lease import LeaseKeeper


def wait_until(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.01)


class Renewals:
    def __init__(self, answer: bool = True):
        self.calls, self.answer, self.lock = 0, answer, threading.Lock()

    def __call__(self) -> bool:
        with self.lock:
            self.calls += 1
        return self.answer


def test_renews_while_the_loop_ticks_and_not_once_it_stalls():
    renew = Renewals()
    keeper = LeaseKeeper(renew, period_s=0.05, stall_s=5.0).start()
    try:
        wait_until(lambda: renew.calls >= 3)  # no tick needed: the last one is recent
        keeper.ticked = time.monotonic() - 10.0  # the loop has not ticked for longer than stall_s
        time.sleep(0.1)  # a renewal already under way may still land
        stalled = renew.calls
        time.sleep(0.3)
        assert renew.calls == stalled, "a stalled loop's lease must lapse"
        keeper.tick()
        wait_until(lambda: renew.calls > stalled)
        assert not keeper.lost
    finally:
        keeper.close()
    closed = renew.calls
    time.sleep(0.2)
    assert renew.calls == closed and not keeper._thread.is_alive()


def test_a_refused_renewal_is_a_lost_lease_and_ends_the_thread():
    renew = Renewals(answer=False)
    keeper = LeaseKeeper(renew, period_s=0.01).start()
    wait_until(lambda: keeper.lost)
    keeper._thread.join(timeout=10)
    assert renew.calls == 1 and not keeper._thread.is_alive()


@pytest.mark.redis
def test_the_keeper_holds_a_real_lease_past_its_life_while_the_loop_is_busy(redis_server):
    control = RunControl(connect(redis_server.url), run_prefix(f"lease-{uuid.uuid4().hex[:8]}"))
    ttl = 3.0  # a renewal every 0.1 s: only a thread starved for ~3 s could miss it
    token = control.join("generator", "g0", ttl_s=ttl)
    keeper = LeaseKeeper(lambda: control.renew("generator", "g0", token, ttl_s=ttl, version=3), period_s=0.1)
    keeper.start()
    try:
        started = time.monotonic()
        while time.monotonic() - started < 2 * ttl:  # the "loop" never renews itself here
            assert control.members("generator") == ["g0"]
            time.sleep(0.05)
    finally:
        keeper.close()
    wait_until(lambda: control.members("generator") == [])  # closed: it lapses
    control.reap("generator")
    assert not control.renew("generator", "g0", token, ttl_s=ttl)  # reaped: the generator would stop
    control.r.close()
