"""``asyncrl launch --resume`` and a launcher's death (issue 11, defects 4 and 12), through the CLI on the
demo: one run is stopped three ways and resumed after each --

1. SIGINT of the launcher (a user's Ctrl-C), which commits a checkpoint of every trained version;
2. ``kill -9`` of every process of the run at once (launcher, redis-server, learners, generators);
3. ``kill -9`` of the launcher alone at a random step (seeded, printed): every child must notice and
   leave by itself;

-- and the last resume finishes it. The run then has every version 1..steps in its history (a resumed
launch redoes the versions after the committed checkpoint: repeats, never a gap), its final greedy
reward reaches the demo's bar, and the buffer's accounting closes with nothing lost.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from demo_launch import DEMO, ROOT, demo_launch_cmd
from test_supervision import latest_version, wait_for

from asyncrl.rundir import pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]
STEPS = 40
SEED = int(os.environ.get("ASYNCRL_RESUME_SEED", "20261201"))
DEMO_BAR = 0.9  # the demo's quality bar (README): greedy held-out reward at the last version


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def resume_cmd(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", "launch", "--resume", str(run_dir)]


def run_pids(run_dir: Path) -> dict[str, int]:
    info = json.loads((run_dir / "run.json").read_text())
    return {"launcher": info["launcher_pid"], "redis-server": info["redis_pid"], **info["pids"]}


def wait_gone(pids: dict[str, int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (alive := {n: p for n, p in pids.items() if pid_alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"still running {timeout_s:.0f}s after their launcher died: {alive}"


def committed_version(run_dir: Path) -> int:
    path = run_dir / "checkpoint" / "committed.json"
    return json.loads(path.read_text())["version"] if path.exists() else 0


def evaluated(run_dir: Path, point: int) -> bool:
    """Whether eval point ``point`` is in the run's metrics (``generators.evaluation``: maybe at a later version)."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
    return any(point in r.get("eval/points", [r.get("eval/point")]) for r in records if "eval/version" in r)


def test_a_run_survives_sigint_kill_9_of_everything_and_a_killed_launcher(tmp_path):
    pytest.importorskip("vllm")
    rng = random.Random(SEED)
    print(f"resume test seed {SEED} (ASYNCRL_RESUME_SEED)")
    run_dir = tmp_path / "resumed"
    versions_at_stop = []

    # 1. Ctrl-C after the first committed checkpoint
    proc = start(demo_launch_cmd(tmp_path, "resumed", "--steps", str(STEPS)))
    try:
        wait_for(lambda: committed_version(run_dir) >= 10, 400, "the first committed checkpoint", proc)
        wait_for(lambda: latest_version(run_dir) >= 12, 400, "two versions after it", proc)
        # the first evaluation too (on a loaded machine it may outlast 12 versions; stopped, it is done on resume)
        wait_for(lambda: evaluated(run_dir, 0), 400, "the first evaluation", proc)
        versions_at_stop.append(latest_version(run_dir))
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 130, out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    # the stop committed every trained version: the resume redoes none of them
    assert committed_version(run_dir) == latest_version(run_dir) >= versions_at_stop[-1] >= 12

    # a plain relaunch of the name refuses (nothing deleted), and says how to go on
    again = subprocess.run(demo_launch_cmd(tmp_path, "resumed"), cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 2 and "--resume" in again.stderr, again.stderr[-2000:]
    assert committed_version(run_dir) >= 10

    # 2. resume, then kill -9 of every process of the run at once
    proc = start(resume_cmd(run_dir))
    try:
        first = committed_version(run_dir)
        wait_for(lambda: committed_version(run_dir) > first, 400, "a checkpoint after the resume", proc)
        versions_at_stop.append(latest_version(run_dir))
        pids = run_pids(run_dir)
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
        wait_gone(pids, 30)
    finally:
        if proc.poll() is None:
            proc.kill()

    # 3. resume, then kill -9 of the launcher alone at a random version before the end
    proc = start(resume_cmd(run_dir))
    try:
        target = rng.randint(committed_version(run_dir) + 1, STEPS - 5)
        print(f"killing the launcher at version {target}")
        wait_for(lambda: latest_version(run_dir) >= target, 400, f"version {target}", proc)
        versions_at_stop.append(latest_version(run_dir))
        pids = run_pids(run_dir)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        children = {n: p for n, p in pids.items() if n != "launcher"}
        wait_gone(children, 60)  # redis-server, learners, generators: each noticed its launcher's death
    finally:
        if proc.poll() is None:
            proc.kill()

    # 4. the last resume finishes the run
    done = subprocess.run(resume_cmd(run_dir), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    history = [r["learner/version"] for r in records if "learner/version" in r]
    print(f"versions at the stops: {versions_at_stop}; {len(history)} steps logged for {STEPS} versions")
    assert set(history) == set(range(1, STEPS + 1))  # no gap (versions after a commit are redone)
    assert summary["final_version"] == STEPS and summary["exit_reason"] == "completed"
    assert summary["buffer"]["lost"] == 0, summary["buffer"]
    assert summary["initial_eval_reward"] is not None  # the history of the first launch is kept
    assert summary["final_eval_reward"] >= DEMO_BAR, summary
    assert not list(Path("/dev/shm").glob(f"asyncrl-w-{pids['learner-0']}-*"))


def test_a_launch_refuses_a_run_directory_whose_processes_still_run(tmp_path):
    """A relaunch (plain with overwrite, or --resume) of a directory that a live launch owns deletes and
    starts nothing: the old processes would go on writing into it."""
    run_dir = tmp_path / "busy"
    (run_dir / "checkpoint").mkdir(parents=True)
    (run_dir / "checkpoint" / "keep").write_text("x")
    orphan = subprocess.Popen(["sleep", "60"])
    try:
        info = {"run_id": "busy-1", "prefix": "asyncrl:{busy-1}:", "launcher_pid": 999_999_999, "pids": {}}
        info.update(redis_pid=orphan.pid, redis_dir=str(run_dir / "redis"))
        (run_dir / "run.json").write_text(json.dumps(info))
        (run_dir / "config.yaml").write_text(DEMO.read_text().replace("name: demo", "name: busy"))
        (run_dir / "redis").mkdir()
        (run_dir / "redis.url").write_text("redis://:pw@127.0.0.1:1/0\n")
        for cmd in (
            demo_launch_cmd(tmp_path, "busy", "--set", "run.overwrite=true"),
            resume_cmd(run_dir),
        ):
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 2 and "still runs: redis-server (pid" in proc.stderr, proc.stderr[-2000:]
            assert (run_dir / "checkpoint" / "keep").exists()
    finally:
        orphan.kill()
        orphan.wait()


def _ended_run_dir(tmp_path, committed: int | None) -> Path:
    run_dir = tmp_path / "ended"
    (run_dir / "redis").mkdir(parents=True)
    info = {"run_id": "ended-1", "prefix": "asyncrl:{ended-1}:", "launcher_pid": None, "pids": {}}
    info["redis_dir"] = str(run_dir / "redis")
    (run_dir / "run.json").write_text(json.dumps(info))
    (run_dir / "config.yaml").write_text("run:\n  name: ended\n  steps: 40\n")
    (run_dir / "redis.url").write_text("redis://:pw@127.0.0.1:1/0\n")
    if committed is not None:
        (run_dir / "checkpoint").mkdir()
        (run_dir / "checkpoint" / "committed.json").write_text(json.dumps({"version": committed, "tag": "v"}))
    return run_dir


def test_resume_reads_the_run_directory_and_refuses_what_it_cannot_continue(tmp_path):
    from asyncrl.errors import UserError
    from asyncrl.run.resume import check_resumable, load_resume_point

    point = load_resume_point(_ended_run_dir(tmp_path, committed=20))
    assert (point.run_id, point.prefix, point.redis_password, point.committed_version) == (
        "ended-1",
        "asyncrl:{ended-1}:",
        "pw",
        20,
    )
    check_resumable(point, steps=40)
    check_resumable(point, steps=20)  # committed its last version, but never finished: resume ends it
    (point.run_dir / "summary.json").write_text(json.dumps({"exit_reason": "completed"}))
    with pytest.raises(UserError, match="complete at version 20"):
        check_resumable(point, steps=20)
    with pytest.raises(UserError, match="run.json is missing"):
        load_resume_point(tmp_path / "nowhere")


def test_a_finished_run_resumes_only_with_more_steps(tmp_path):
    run_dir = _ended_run_dir(tmp_path, committed=40)
    (run_dir / "summary.json").write_text(json.dumps({"exit_reason": "completed"}))
    proc = subprocess.run(resume_cmd(run_dir), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "complete at version 40" in proc.stderr and "--steps" in proc.stderr
    proc = subprocess.run([*resume_cmd(run_dir), "--config", "x.yaml"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "own config.yaml" in proc.stderr
