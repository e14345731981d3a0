"""A run's processes live no longer than their launcher, and one run directory has one launch at a time.

- Every child the launcher starts (redis-server, learner ranks, generators) asks the kernel, between
  fork and exec, for SIGTERM when the launcher dies (``PR_SET_PDEATHSIG``), so ``kill -9`` of the
  launcher ends them too: redis-server flushes its AOF on SIGTERM, learners and generators leave
  whatever they had not committed, which a resumed or new run redoes. A child whose launcher died
  before the request took effect exits at once.
- ``run.json`` names the pids of the launch that owns a run directory; a relaunch of the same
  directory refuses while any of them still runs (:func:`live_processes`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl.errors import UserError
from asyncrl.status import pid_alive, read_run_info

_PR_SET_PDEATHSIG = 1
try:  # resolved here, in the parent: a child between fork and exec should only make the call
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: children outlive a killed launcher there
    _prctl = None


def die_with(parent_pid: int, sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` step: the child gets ``sig`` when ``parent_pid`` (the forking thread) dies.

    Popen must be called from the launcher's main thread: the kernel watches the thread that forked.
    """

    def request() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent_pid:  # orphaned before the request: the signal will never come
            os._exit(1)

    return request


def live_processes(run_dir: Path) -> dict[str, int]:
    """``{name: pid}`` of the processes that ``run_dir/run.json`` names and that still run: the launcher,
    redis-server and every child of the launch that owns the directory."""
    try:
        info = read_run_info(Path(run_dir))
    except UserError:  # no run there, or not one this code wrote: nobody to wait for
        return {}
    if not isinstance(info, dict):
        return {}
    named = {"launcher": info.get("launcher_pid"), "redis-server": info.get("redis_pid")}
    pids = info.get("pids")
    if isinstance(pids, dict):
        named.update(pids)
    return {
        name: pid
        for name, pid in named.items()
        if isinstance(pid, int) and pid > 0 and pid != os.getpid() and pid_alive(pid)
    }


def stop_processes(children: list, grace_s: float = 0.0) -> None:
    """Wait up to ``grace_s`` for children to leave on their own, then SIGTERM, then SIGKILL each
    one's process group (a child's own children go with it)."""
    deadline = time.monotonic() + grace_s
    live = [c for c in children if c.proc is not None]
    while time.monotonic() < deadline and any(c.proc.poll() is None for c in live):
        time.sleep(0.1)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for c in live:
            if c.proc.poll() is None:
                try:
                    os.killpg(c.proc.pid, sig)
                except ProcessLookupError:
                    pass
        for c in live:
            try:
                c.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
