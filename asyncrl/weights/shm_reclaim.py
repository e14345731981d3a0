"""Directories of shm bus publishers that died without cleaning up, and their removal.

A publisher's directory is ``<root>/asyncrl-w-<pid>-<random>`` holding ``owner.json``
(``{"pid": int, "start": int | null}``, the start time in clock ticks from ``/proc/<pid>/stat``,
so a reused pid is told apart). Its owner removes it on ``close`` and at normal interpreter exit; one
killed by a signal leaves it behind for ``remove_stale_shm`` (the launcher calls it at the end of a run).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("asyncrl.weights")  # base's logger; base itself imports torch

DEFAULT_ROOT = "/dev/shm"
DIR_PREFIX = "asyncrl-w-"
_DIR_RE = re.compile(re.escape(DIR_PREFIX) + r"(\d+)-\w+")


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is [0], start time is [19])."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def owner_record(pid: int) -> dict:
    """What ``owner.json`` holds for process ``pid``."""
    fields = _proc_stat(pid)
    return {"pid": pid, "start": int(fields[19]) if fields and len(fields) > 19 else None}


def owner_alive(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` (started at clock tick ``start``, if known) still runs; a zombie and a
    reused pid count as dead. Only meaningful in the publisher's pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    fields = _proc_stat(pid)
    if fields is None:
        return True  # no /proc: trust kill()
    if fields[0] in ("Z", "X"):
        return False
    return start is None or len(fields) <= 19 or int(fields[19]) == start


def remove_stale_shm(root: str = DEFAULT_ROOT, alive: Callable[[int, int | None], bool] = owner_alive) -> list[str]:
    """Remove the shm bus directories under ``root`` whose publisher process is dead; returns them.

    ``alive(pid, start)`` decides (default: ``owner_alive``). Live publishers' directories, and
    anything not named like one, are left alone.
    """
    removed = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return removed
    for entry in entries:
        m = _DIR_RE.fullmatch(entry.name)
        if not m or not entry.is_dir(follow_symlinks=False):
            continue
        pid, start = int(m[1]), None
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            owner = json.loads(Path(entry.path, "owner.json").read_text())
            pid, start = int(owner["pid"]), owner.get("start")
        if alive(pid, start):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        log.info("weights: removed %s of dead publisher %d", entry.path, pid)
        removed.append(entry.path)
    return removed


def remove_stale_weights(weights, say: Callable[[str], None]) -> None:
    """The launcher's sweep: dead publishers' versions in the default tmpfs and, for ``weights.type=shm``, in
    the run's own ``weights.dir``, each removal said."""
    roots = {DEFAULT_ROOT, weights.dir} if weights.type == "shm" else {DEFAULT_ROOT}
    for root in sorted(r for r in roots if os.path.isdir(r)):
        for path in remove_stale_shm(root):
            say(f"removed shared-memory weights of a dead learner: {path}")
