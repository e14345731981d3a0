"""The commit marker of learner checkpoints: which saved version a restart resumes from (no torch).

Checkpoints live in ``<run>/checkpoint/version-<v>/``. One is *committed* when
``<run>/checkpoint/committed.json`` (``{"version": v, "tag": "version-<v>"}``) names it. Learner rank 0
writes the marker atomically, only after every rank saved its part (``engine.save_checkpoint``); a
restarted learner resumes from it and nothing else, and the launcher reads it to say where.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.rundir import write_atomic

COMMITTED = "committed.json"


def read_committed(ckpt_dir: Path) -> dict | None:
    """``{"version": int, "tag": str}`` of the committed checkpoint under ``ckpt_dir``, or None."""
    marker = Path(ckpt_dir) / COMMITTED
    if not marker.is_file():
        return None
    committed = json.loads(marker.read_text())
    return {"version": int(committed["version"]), "tag": str(committed["tag"])}


def write_committed(ckpt_dir: Path, version: int, tag: str) -> None:
    write_atomic(Path(ckpt_dir) / COMMITTED, json.dumps({"version": version, "tag": tag}))
