"""The launcher's supervision through the CLI: a killed generator is restarted (and its unpushed
groups' admission slots given back, or the synchronous run would stall), and Ctrl-C stops every
process the launcher started, flushes metrics and writes the summary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from demo_launch import ROOT, demo_launch_cmd

from asyncrl.rundir import pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]


def latest_version(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    versions = [json.loads(line).get("learner/version", 0) for line in path.read_text().splitlines() if line]
    return max(versions, default=0)


def run_tails(run_dir: Path, lines: int = 20) -> str:
    """The end of every log of the run, for a failure message: what each process was doing."""
    out = []
    for path in sorted((run_dir / "logs").glob("*.log")) + sorted(run_dir.parent.glob("*.out")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {path.name}\n" + "\n".join(tail))
    return "\n".join(out)


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen, run_dir: Path | None = None) -> None:
    """Until ``predicate()``; a timeout's message ends with the tails of ``run_dir``'s logs."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"launcher exited early ({proc.returncode}) while waiting for {what}"
        # the logs' tails are read for the message only (it is built when the assertion fails)
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{run_tails(run_dir) if run_dir else ''}"
        time.sleep(0.1)  # a poll reads a file or two: seeing the state 0.1 s late at most costs nothing


def test_generator_restart_and_ctrl_c(tmp_path):
    pytest.importorskip("vllm")
    run_dir, launcher_out = tmp_path / "sup", tmp_path / "launcher.out"
    with launcher_out.open("w") as out_file:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            demo_launch_cmd(
                tmp_path,
                "sup",
                "--generators",
                "2",
                "--learners",
                "1",
                "--max-policy-lag",
                "0",
                "--steps",
                "10000",
                "--set",
                "run.eval_every=0",
            ),
            cwd=ROOT,
            stdout=out_file,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        wait_for(lambda: latest_version(run_dir) >= 3, 300, "version 3", proc, run_dir)
        info = json.loads((run_dir / "run.json").read_text())
        victim = info["pids"]["generator-0"]
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: json.loads((run_dir / "run.json").read_text())["pids"]["generator-0"] != victim,
            60,
            "generator-0 restart",
            proc,
            run_dir,
        )
        # synchronous mode keeps going only if the dead generator's admitted groups were released
        reached = latest_version(run_dir)
        wait_for(lambda: latest_version(run_dir) >= reached + 5, 300, "progress after the restart", proc, run_dir)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = launcher_out.read_text()
    assert proc.returncode == 130, out[-2000:]
    assert "Traceback" not in out
    info = json.loads((run_dir / "run.json").read_text())
    pids = [*info["pids"].values(), info["redis_pid"], victim]
    assert not [p for p in pids if pid_alive(p)], "processes left running after Ctrl-C"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "interrupted" and summary["final_version"] >= reached + 5
    assert latest_version(run_dir) == summary["final_version"]  # metrics were flushed
    assert "restarting" in out


def test_a_dead_learner_stops_the_run_with_a_clear_error(tmp_path):
    pytest.importorskip("vllm")
    run_dir = tmp_path / "dead-learner"
    proc = subprocess.Popen(
        demo_launch_cmd(
            tmp_path,
            "dead-learner",
            "--generators",
            "1",
            "--learners",
            "2",
            "--steps",
            "10000",
            "--set",
            "run.eval_every=0",
            "--set",
            "learner.max_restarts=0",
        ),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: latest_version(run_dir) >= 1, 300, "version 1", proc, run_dir)
        info = json.loads((run_dir / "run.json").read_text())
        assert "forkserver-learner" in info["pids"], "CPU ranks are forked from a server (run.fork_learners)"
        maps = Path(f"/proc/{info['pids']['learner-1']}/maps").read_text()
        assert "jemalloc" in maps, "a forked rank runs on its server's allocator (learner.jemalloc)"
        os.kill(info["pids"]["learner-1"], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode not in (0, None)
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("asyncrl: error: ")]
    assert errors and errors[0].startswith("asyncrl: error: learner-1 exited with code -9"), err[-2000:]
    pids = [*info["pids"].values(), info["redis_pid"]]
    assert not [p for p in pids if pid_alive(p)], "processes left running after a learner died"
    assert json.loads((run_dir / "summary.json").read_text())["exit_reason"] == "failed"
