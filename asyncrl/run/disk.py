"""The launcher and a full disk under the run directory.

- A full disk ends the run with one error (``asyncrl.observe.metrics.DiskFull``) naming the path and the
  space left, exit code 2, whichever write failed first: the launcher's own (metrics, samples, run.json),
  or a child's (a learner's checkpoint, redis-server's append-only file), which the launcher learns of when
  the child dies (:func:`check_full_disk`). A dead child is then not restarted: it would fail again.
- It still writes ``summary.json``: the launcher holds a :class:`Reserve` in the run directory from its
  start and frees it only at the end, once every child stopped, for the last metric records and the
  summary. Removing the partial checkpoint (``learners.checkpoint.remove_uncommitted``) frees more. If
  even the summary cannot be written (the disk filled past the reserve meanwhile, or a filesystem that
  refuses the write for another reason), it is printed on the console instead, as one line of JSON, and
  ``summary.json`` is left as it was (absent, or a resumed run's previous one).
- One checkpoint ahead, the disk's room for the next checkpoint is a metric after every commit
  (:class:`CheckpointRoom`), and a warning line while the next one will not fit.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from asyncrl.learners.checkpoint import checkpoint_room, room_fits, room_shortfall
from asyncrl.observe.metrics import DiskFull, free_bytes, human_bytes, is_disk_full

RESERVE_FILE = ".reserve"
# summary.json is a few KB; the records children sent after the disk filled, a few hundred bytes each
RESERVE_BYTES = 1 << 20
# a write that failed for want of space leaves at most about this much free: a short write fills the disk
# to the block, and redis-server cuts its append-only file back by one event loop's commands (tens of KB)
LOW_SPACE_BYTES = 1 << 20


class Reserve:
    """Space held in the run directory (``.reserve``) for the end of a run on a full disk."""

    def __init__(self, run_dir: Path, size: int = RESERVE_BYTES):
        self.path = Path(run_dir) / RESERVE_FILE
        self.size = size

    def take(self) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.size)  # blocks of its own, not a sparse file
            finally:
                os.close(fd)
        except OSError as exc:
            self.release()
            if is_disk_full(exc):
                raise DiskFull(self.path, f"; a run needs more than {human_bytes(self.size)} free to start") from None
            raise

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def check_full_disk(run_dir: Path, failed: str) -> None:
    """Raise DiskFull when ``failed`` (a child that died) is likely the disk's doing: the run directory's
    disk is as full as a failed write leaves it. The run then ends; nothing restarts (it would fail again)."""
    if free_bytes(run_dir) < LOW_SPACE_BYTES:
        raise DiskFull(run_dir, f": {failed}")


def run_error(exc: Exception, run_dir: Path) -> Exception:
    """What a run that failed with ``exc`` ends with: a full disk as one DiskFull saying how to go on (the
    launcher's own writes fail with a bare OSError), anything else as it is."""
    error = DiskFull(exc.filename or run_dir) if is_disk_full(exc) else exc
    if isinstance(error, DiskFull):
        error.args = (f"{error}; free some space, then go on with: asyncrl launch --resume {run_dir}",)
    return error


class CheckpointRoom:
    """After each commit (a learner's ``checkpoint/version`` record), the disk's room for the next
    checkpoint, which is saved beside the committed one: ``checkpoint/disk_free_gb``,
    ``checkpoint/size_gb`` (the committed one's, the estimate) and ``checkpoint/next_fits`` (0 or 1)."""

    def __init__(self, ckpt_dir: Path):
        self.ckpt_dir = Path(ckpt_dir)

    def after_commit(self, record: dict) -> tuple[dict | None, str | None]:
        """(the metric record, a warning line or None); (None, None) when there is no checkpoint to measure."""
        room = checkpoint_room(self.ckpt_dir)
        if room is None:
            return None, None
        free, size = room
        fits = room_fits(free, size)
        metric = {
            "time": record.get("time", time.time()),
            "checkpoint/version": record["checkpoint/version"],
            "checkpoint/disk_free_gb": free / 1e9,
            "checkpoint/size_gb": size / 1e9,
            "checkpoint/next_fits": int(fits),
        }
        return metric, None if fits else room_shortfall(self.ckpt_dir)
