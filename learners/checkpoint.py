"""The commit marker of learner checkpoints: which saved version a restart resumes from (no torch).

Checkpoints live in ``<run>/checkpoint/version-<v>/``. One is *committed* when
``<run>/checkpoint/committed.json`` (``{"version": v, "tag": "version-<v>"}``) names it. Learner rank 0
writes the marker atomically, only after every rank saved its part (``deepspeed_engine.save_checkpoint``);
a restarted learner resumes from it and nothing else, and the launcher reads it to say where.

Any other ``version-<v>/`` is a save that never finished (a rank died in it, the disk filled): a restart
or resume ignores it, and the launcher removes it (:func:`remove_uncommitted`) whenever no learner rank
runs. The next save is written beside the committed one before that is removed, so it needs about one
checkpoint's size free (:func:`room_shortfall`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from asyncrl.observe.metrics import free_bytes, human_bytes
from asyncrl.rundir import write_atomic

COMMITTED = "committed.json"
# the next checkpoint must find this many times the last one's size free: sizes vary a little between
# versions (the ranks' state files), and logs, metrics and the buffer's file grow until it is saved
ROOM_MARGIN = 1.1


def read_committed(ckpt_dir: Path) -> dict | None:
    """``{"version": int, "tag": str}`` of the committed checkpoint under ``ckpt_dir``, or None."""
    marker = Path(ckpt_dir) / COMMITTED
    if not marker.is_file():
        return None
    committed = json.loads(marker.read_text())
    return {"version": int(committed["version"]), "tag": str(committed["tag"])}


def write_committed(ckpt_dir: Path, version: int, tag: str) -> None:
    write_atomic(Path(ckpt_dir) / COMMITTED, json.dumps({"version": version, "tag": tag}))


def remove_uncommitted(ckpt_dir: Path) -> list[str]:
    """Remove every ``version-<v>/`` under ``ckpt_dir`` that the marker does not name; their names.
    Only while no learner rank runs: a rank's save in progress is uncommitted too."""
    committed = read_committed(ckpt_dir)
    keep = committed["tag"] if committed is not None else None
    removed = sorted(p.name for p in Path(ckpt_dir).glob("version-*") if p.is_dir() and p.name != keep)
    for name in removed:
        shutil.rmtree(Path(ckpt_dir) / name, ignore_errors=True)
    return removed


def checkpoint_room(ckpt_dir: Path) -> tuple[int, int] | None:
    """(bytes free on the filesystem of ``ckpt_dir``, bytes of the committed checkpoint: the next one's
    estimate), or None before the first commit (or while a newer commit removes the one read)."""
    committed = read_committed(ckpt_dir)
    if committed is None:
        return None
    try:
        size = sum(p.stat().st_size for p in (Path(ckpt_dir) / committed["tag"]).rglob("*") if p.is_file())
    except OSError:
        return None
    return free_bytes(ckpt_dir), size


def room_fits(free: int, size: int) -> bool:
    return free >= size * ROOM_MARGIN


def room_shortfall(ckpt_dir: Path) -> str | None:
    """A warning when the disk will not hold the next checkpoint beside the committed one, else None."""
    room = checkpoint_room(ckpt_dir)
    if room is None or room_fits(*room):
        return None
    free, size = room
    return (
        f"the next checkpoint will not fit in {ckpt_dir}: it needs about {human_bytes(size)} (the last one's "
        f"size) and {human_bytes(free)} are free; free some space or the run stops when the disk is full"
    )
