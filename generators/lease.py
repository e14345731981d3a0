"""A generator's lease in the fleet, kept alive by a thread of its own while the generator makes progress.

The lease says the process lives: once it lapses (``MEMBER_TTL_S``, 10 s), the launcher's reaper gives the
generator's admission slots back and the generator must stop before it pushes a group it no longer holds.
Renewed only at the event loop's tick, it lapsed under a niced generator that generators starting beside
it on 2 cores starved for over 10 s (tests/e2e/test_fleet_launch.py, once in a suite): the process lived and
worked, and was restarted for nothing. The keeper renews it every ``PERIOD_S`` with the loop's last
heartbeat fields while the loop has ticked within ``STALL_S``; a loop stuck longer than that lets it lapse, as
before, and a dead process's lapses in ``MEMBER_TTL_S`` as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("asyncrl.generator")

PERIOD_S = 1.0
STALL_S = 60.0  # the longest the event loop may go without a tick before the lease is left to lapse


class LeaseLost(RuntimeError):
    """This generator's lease expired (it stalled) and the run gave its admission slots away."""


class LeaseKeeper:
    """``renew()`` (False: the lease is gone) on a daemon thread; the loop calls :meth:`tick` at each tick and
    checks :attr:`lost`."""

    def __init__(self, renew: Callable[[], bool], period_s: float = PERIOD_S, stall_s: float = STALL_S):
        self._renew, self.period_s, self.stall_s = renew, period_s, stall_s
        self.ticked = time.monotonic()
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def tick(self) -> None:
        self.ticked = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if time.monotonic() - self.ticked > self.stall_s:
                continue  # the loop is stuck: the lease lapses, as it must
            try:
                if not self._renew():
                    self.lost = True
                    return
            except Exception as exc:  # Redis unreachable: the loop's own calls meet it and retry
                log.debug("lease renewal failed: %s", exc)

    def close(self) -> None:
        """Stop renewing (before leaving the fleet: a renewal after the leave would find no lease)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
