"""``asyncrl launch --resume runs/<name>``: continue a stopped or crashed run where it was committed.

Everything a run needs to go on is already on disk: the committed learner checkpoint
(``checkpoint/committed.json``) and the buffer in the Redis append-only file (``redis/``). A resumed
launch reuses the run's id, key prefix, Redis password and directory; its redis-server loads the AOF;
its learner ranks restore the committed checkpoint and take back the entries they had pending (exactly
what a learner restart does, see ``learners/trainer.py``), so the accounting identity goes on holding
and no group is trained past its replay budget. What the old launch left mid-flight is undone here,
before any child starts (:func:`reset_for_resume`): the stop request, the old weight-bus address and
heartbeats, the admission slots of groups its generators admitted but never pushed, and the claim of
an evaluation that never reported.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from urllib.parse import unquote, urlsplit

from asyncrl.errors import UserError
from asyncrl.learners.checkpoint import read_committed
from asyncrl.rundir import read_run_info


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """What a resumed launch takes over from the run directory of the launch before it."""

    run_dir: Path
    run_id: str
    prefix: str
    redis_dir: Path | None  # the AOF of the run's own redis-server; None: it used an external one
    redis_password: str | None
    committed_version: int  # 0 when no checkpoint was committed: the learners start over from the model


def load_resume_point(run_dir: str | Path) -> ResumePoint:
    """Read a run directory for ``--resume``; one UserError naming what is missing."""
    run_dir = Path(run_dir)
    info_path, config_path = run_dir / "run.json", run_dir / "config.yaml"
    for path in (info_path, config_path):
        if not path.is_file():
            raise UserError(f"cannot resume {run_dir}: {path.name} is missing (is it a run directory?)")
    info = read_run_info(run_dir)
    try:
        run_id, prefix = str(info["run_id"]), str(info["prefix"])
        redis_dir = Path(info["redis_dir"]) if info.get("redis_dir") else None
    except (KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"cannot resume {run_dir}: run.json is unreadable ({exc!r})") from None
    password = None
    if redis_dir is not None:
        if not redis_dir.is_dir():
            raise UserError(f"cannot resume {run_dir}: its Redis data {redis_dir} is gone")
        password = _password(run_dir / "redis.url")
    committed = read_committed(run_dir / "checkpoint")
    return ResumePoint(
        run_dir=run_dir,
        run_id=run_id,
        prefix=prefix,
        redis_dir=redis_dir,
        redis_password=password,
        committed_version=int(committed["version"]) if committed is not None else 0,
    )


def _password(url_file: Path) -> str:
    try:
        url = url_file.read_text().strip()
    except OSError as exc:
        raise UserError(f"cannot resume: {url_file} is unreadable ({exc})") from None
    password = urlsplit(url).password
    if not password:
        raise UserError(f"cannot resume: {url_file} holds no password")
    return unquote(password)


def check_resumable(point: ResumePoint, steps: int) -> None:
    """A run that completed (its summary says so) resumes only to train further. One stopped after its
    last commit but before its end (final evaluation, summary) resumes to finish that."""
    if point.committed_version < steps:
        return
    try:
        completed = json.loads((point.run_dir / "summary.json").read_text()).get("exit_reason") == "completed"
    except (OSError, ValueError, AttributeError):
        completed = False
    if completed:
        raise UserError(
            f"{point.run_dir} is complete at version {point.committed_version}; "
            f"to train further, raise run.steps (--steps N) above it"
        )


def reset_for_resume(control, buffer, eval_points_done: set[int]) -> dict[str, int]:
    """Undo what the previous launch left mid-flight (module doc); returns what was released."""
    control.clear_stop()
    control.forget_meta("weights_address")
    control.forget_meta("final_version")
    control.forget_meta("fatal")  # a run stopped by its failure limit gets another chance
    control.forget_heartbeats()
    unpushed = buffer.release_held(resume=True)  # every producer's (none survived); journaled ones resume
    evals = control.forget_eval_claims(keep=eval_points_done)
    return {"released_slots": unpushed, "eval_claims_dropped": evals}
