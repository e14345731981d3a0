"""A full disk under the run directory (issue 25): one error line naming the path and the free space, every
child stopped, ``summary.json`` written, partial checkpoints removed, exit code 2; and a warning (a metric
and a line) one checkpoint ahead when the disk will not hold the next one.

The disks are real: small tmpfs mounts made by the test (it needs root; it skips without, and fails under
CI), unmounted at teardown.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from demo_launch import DEMO, ROOT, demo_launch_cmd
from metrics_fixtures import Stream
from services import in_ci

from asyncrl.config import RunConfig, load_config
from asyncrl.errors import UserError
from asyncrl.learners.checkpoint import read_committed, write_committed
from asyncrl.lifetime import Child
from asyncrl.observe.metrics import read_metrics
from asyncrl.run.launch import Launcher
from asyncrl.run.stats import RunStats
from asyncrl.rundir import pid_alive

MB = 1_000_000  # decimal, as the lines and metrics count


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[[str], Path]]:
    """``tmpfs("14m")``: a new tmpfs of that size, mounted under ``tmp_path``."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if done.returncode != 0:
            msg = f"cannot mount a tmpfs (needs root): {done.stderr.decode().strip()}"
            pytest.fail(msg + "; CI=true, so this is a failure") if in_ci() else pytest.skip(msg)
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)  # busy: detached now, freed when let go


def fill(disk: Path, leave: int = 0) -> Path:
    """Fill ``disk`` with one file until no byte (or about ``leave`` bytes) is left."""
    path = disk / "filler"
    with path.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    if leave:
        with path.open("r+b") as f:
            f.truncate(max(0, path.stat().st_size - leave))
    return path


def big_record(i: int) -> dict:
    """A record larger than a page: a write that needs a new block of the disk."""
    return {"time": 1.0 + i, "source": "generator/0", "generator/version": i, "note": "x" * 8192}


def test_metrics_on_a_full_disk_are_one_error_naming_the_file_and_the_free_space(tmpfs):
    disk = tmpfs("1m")
    run_dir = disk / "run"
    run_dir.mkdir()
    stats = RunStats(RunConfig(), run_dir)
    stats.drain(Stream([big_record(0)]))
    fill(disk)
    with pytest.raises(UserError) as err:
        stats.drain(Stream([big_record(1), big_record(2)]))
    message = str(err.value)
    assert "\n" not in message and "no space left on device" in message, message
    assert str(run_dir / "metrics.jsonl") in message and "free" in message, message
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [r["generator/version"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0]
    (disk / "filler").unlink()  # space again: nothing of the failure is left to break the summary
    stats.write_summary(run_dir, "disk_full")
    assert json.loads((run_dir / "summary.json").read_text())["exit_reason"] == "disk_full"


def test_the_run_keeps_room_for_its_summary_on_a_full_disk(tmpfs):
    from asyncrl.run.disk import Reserve

    disk = tmpfs("4m")
    run_dir = disk / "run"
    run_dir.mkdir()
    stats = RunStats(RunConfig(), run_dir)
    reserve = Reserve(run_dir)
    reserve.take()
    fill(disk)
    reserve.release()  # as the launcher does once every child stopped, before its last records and summary
    stats.drain(Stream([big_record(0)]))
    stats.write_summary(run_dir, "disk_full")
    assert json.loads((run_dir / "summary.json").read_text())["exit_reason"] == "disk_full"
    assert not (run_dir / ".reserve").exists()


def committed_checkpoint(run_dir: Path, version: int, size: int) -> Path:
    ckpt = run_dir / "checkpoint"
    (ckpt / f"version-{version}").mkdir(parents=True)
    (ckpt / f"version-{version}" / "mp_rank_00_model_states.pt").write_bytes(b"\1" * size)
    write_committed(ckpt, version, f"version-{version}")
    return ckpt


def test_the_next_checkpoint_that_will_not_fit_is_warned_a_checkpoint_ahead(tmpfs):
    disk = tmpfs("8m")
    run_dir = disk / "run"
    committed_checkpoint(run_dir, 2, 3 * MB)
    stats, said = RunStats(RunConfig(), run_dir), []
    commit = {"time": 5.0, "source": "learner/0", "checkpoint/seconds": 0.1}
    stats.drain(Stream([{**commit, "checkpoint/version": 2}]), say=said.append)
    assert said == []  # 5 MB free for the next 3 MB
    fill(disk, leave=2 * MB)
    stats.drain(Stream([{**commit, "checkpoint/version": 4}]), say=said.append)
    assert len(said) == 1 and "will not fit" in said[0] and str(run_dir) in said[0], said
    assert "3.0 MB" in said[0] and "free" in said[0], said
    marks = [r for r in read_metrics(run_dir / "metrics.jsonl") if "checkpoint/disk_free_gb" in r]
    assert [(r["checkpoint/version"], r["checkpoint/next_fits"]) for r in marks] == [(2, 1), (4, 0)]
    assert marks[0]["checkpoint/size_gb"] == pytest.approx(3 * MB / 1e9, rel=0.01)
    assert marks[1]["checkpoint/disk_free_gb"] < marks[1]["checkpoint/size_gb"]


def test_the_learner_checks_the_room_before_it_saves(tmpfs):
    """What a learner rank logs right before a save that will not fit (learners.deepspeed_engine.save_checkpoint)."""
    from asyncrl.learners.checkpoint import room_shortfall

    disk = tmpfs("8m")
    ckpt = committed_checkpoint(disk / "run", 2, 3 * MB)
    assert room_shortfall(ckpt) is None
    fill(disk, leave=MB)
    warning = room_shortfall(ckpt)
    assert warning is not None and "3.0 MB" in warning and str(ckpt) in warning, warning
    assert room_shortfall(disk / "run" / "no-checkpoint-yet") is None  # nothing to estimate from


def test_a_resume_ignores_an_uncommitted_later_checkpoint_and_the_launcher_removes_it(tmp_path):
    from asyncrl.learners.checkpoint import remove_uncommitted

    ckpt = committed_checkpoint(tmp_path, 2, 1000)
    (ckpt / "version-4").mkdir()
    (ckpt / "version-4" / "mp_rank_00_model_states.pt").write_bytes(b"\1" * 10)  # a save the disk cut short
    assert read_committed(ckpt) == {"version": 2, "tag": "version-2"}  # what a restarted learner restores
    assert remove_uncommitted(ckpt) == ["version-4"]
    assert (ckpt / "version-2").is_dir() and not (ckpt / "version-4").exists()
    assert remove_uncommitted(ckpt) == []
    (ckpt / "committed.json").unlink()  # none committed yet: every saved version is partial
    assert remove_uncommitted(ckpt) == ["version-2"]


def test_a_child_that_dies_on_a_full_disk_ends_the_run_instead_of_restarting(tmpfs):
    """A learner's checkpoint or redis-server's append-only file may be the write that fails: the launcher
    learns of it when the process dies, and restarting it would only fail again."""
    disk = tmpfs("4m")
    launcher = Launcher(load_config(DEMO, {"run.out_dir": str(disk), "run.name": "run"}))
    launcher.run_dir.mkdir()
    dead = Child("learner", 0, [sys.executable, "-c", "raise SystemExit(1)"], {}, disk / "learner-0.log")
    dead.start()
    dead.proc.wait()
    launcher.children = [dead]
    fill(disk)
    with pytest.raises(UserError, match=r"^no space left on device in .*/run \(\d+ B free there\): learner-0 exited"):
        launcher.check_children(control=None)
    launcher.redis = SimpleNamespace(is_running=lambda: False)  # the run's redis-server died
    with pytest.raises(UserError, match=r"^no space left on device in .*/run .*: redis-server died$"):
        launcher.check_redis()
    assert launcher.learner_restarts == 0 and launcher.redis_restarts == 0


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.vllm
def test_a_launch_on_a_full_disk_stops_with_one_line_a_summary_and_exit_2(tmpfs):
    """14 MB holds one committed demo checkpoint (about 8 MB) but not the next beside it: whichever write
    fails first (a checkpoint, the Redis append-only file, metrics), the end is the same."""
    pytest.importorskip("vllm")
    disk = tmpfs("14m")
    run_dir = disk / "full"
    cmd = demo_launch_cmd(disk, "full", "--generators", "1", "--learners", "1", "--steps", "200")
    cmd += ["--set", "run.eval_every=0", "--set", "learner.checkpoint_every=2", "--set", "run.timeout_s=600"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("asyncrl: error: ")]
    assert len(errors) == 1 and "no space left on device" in errors[0], out[-4000:]
    assert str(run_dir) in errors[0] and " free" in errors[0], errors[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "disk_full" and "no space left" in summary["error"]
    info = json.loads((run_dir / "run.json").read_text())
    assert not [p for p in [*info["pids"].values(), info["redis_pid"]] if pid_alive(p)], "processes left running"
    committed = read_committed(run_dir / "checkpoint")
    kept = {p.name for p in (run_dir / "checkpoint").glob("version-*")}
    assert kept <= ({committed["tag"]} if committed else set()), (kept, committed)
    assert not list(run_dir.glob("*.tmp")), "a half-written file is left"
