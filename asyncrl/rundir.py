"""The run directory's shared files: ``run.json`` and the other files that processes read while they are being
rewritten, and whether the processes that ``run.json`` names still live."""

from __future__ import annotations

import json
import os
from pathlib import Path

from asyncrl.errors import UserError


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` so that a reader sees the old file or the new one, never a part (fsync + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


RUNS_DIR = "runs"  # run.out_dir's default: where ``asyncrl launch`` puts runs/<name>


def find_run_dir(name_or_path: str | Path, runs_dir: str | Path = RUNS_DIR) -> Path:
    """The run directory a user named: a path to one (``runs/x``, ``/abs/runs/x``) or a run's name as ``launch``
    names runs (``x``: ``runs/x``); a path wins where both exist. UserError naming both places when neither
    holds a ``run.json``."""
    given = Path(name_or_path)
    candidates = [given]
    if len(given.parts) == 1 and given.name not in (".", ".."):
        candidates.append(Path(runs_dir) / given)
    for path in candidates:
        if (path / "run.json").is_file():
            return path
    if len(candidates) == 1:
        raise UserError(f"no run at {given}: run.json not found")
    raise UserError(f"no run named {name_or_path}: neither {given} nor {candidates[1]} holds a run.json")


def read_run_info(run_dir: Path) -> dict:
    path = run_dir / "run.json"
    if not path.is_file():
        raise UserError(f"no run at {run_dir}: run.json not found")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None


def pid_alive(pid: int | None) -> bool:
    """True if ``pid`` runs and is not a zombie (a pid that was reused reads as alive: rare, harmless)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True
