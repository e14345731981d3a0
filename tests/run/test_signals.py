"""Ctrl-C and SIGTERM stop a launch whatever signal dispositions it inherited (issue 25).

A non-interactive shell starts a background job (``cmd &``, nohup, many CI runners) with SIGINT ignored,
and Python then installs no KeyboardInterrupt handler: a command that documents Ctrl-C must install its
own. Each test starts the command as such a job runs: from a parent that ignores SIGINT (an ignored
disposition survives exec). Ctrl-C ends a launch with exit code 130 and SIGTERM with 143 (128 + the
signal), both after the orderly stop: every process it started ends and ``summary.json`` is written.
No test waits a fixed time: each signals once the command shows it is past the point under test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from demo_launch import ROOT, demo_launch_cmd
from services import require_redis_binary

from asyncrl.observe.metrics import read_metrics
from asyncrl.rundir import pid_alive

# the parent a background job has: SIGINT ignored, then exec of the command (the disposition carries over)
IGNORING_SIGINT = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])",
]
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
REASONS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}


def start_ignoring_sigint(cmd: list[str], out: Path) -> subprocess.Popen:
    with out.open("w") as f:  # the child keeps its own copy of the descriptor
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}  # its lines as printed, none wrapped
        return subprocess.Popen([*IGNORING_SIGINT, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)


def signal_mask(pid: int, field: str) -> int:
    """``SigIgn`` or ``SigCgt`` of ``pid``: the signals it ignores, or catches, as a bit mask."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def ignores(pid: int, sig: int) -> bool:
    return bool(signal_mask(pid, "SigIgn") & (1 << (sig - 1)))


def children_of(pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:  # exited meanwhile
            continue
        if fields.get("PPid", "").strip() == str(pid):
            out.append(int(status.parent.name))
    return out


def fleet_sizes(run_dir: Path) -> list[int]:
    """The live fleet's size at every change, as the launcher logged it."""
    return [r["fleet/generators"] for r in read_metrics(run_dir / "metrics.jsonl") if "fleet/generators" in r]


def wait_until(predicate, timeout_s: float, what: str, proc: subprocess.Popen, out: Path) -> None:
    """Until ``predicate()`` (the timeout only bounds a failure)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"exited early ({proc.returncode}) waiting for {what}:\n{out.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{out.read_text()[-3000:]}"
        time.sleep(0.2)


def stop(proc: subprocess.Popen, sig: int, out: Path) -> None:
    proc.send_signal(sig)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{signal.Signals(sig).name} did not stop it:\n{out.read_text()[-3000:]}")


def test_the_parent_of_these_tests_really_ignores_sigint(tmp_path):
    """The premise: a command started this way ignores SIGINT unless it installs a handler itself."""
    proc = start_ignoring_sigint(["/bin/sleep", "60"], tmp_path / "out")
    try:
        execd = lambda: Path(f"/proc/{proc.pid}/exe").resolve().name == "sleep"  # noqa: E731
        wait_until(execd, 30, "the exec", proc, tmp_path / "out")
        assert ignores(proc.pid, signal.SIGINT)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.vllm
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_launch_started_ignoring_sigint_stops_on_ctrl_c_with_130_and_on_sigterm_with_143(tmp_path, sig):
    pytest.importorskip("vllm")
    run_dir, out = tmp_path / "sig", tmp_path / "launcher.out"
    args = ("--generators", "1", "--learners", "1", "--steps", "10000", "--set", "run.eval_every=0")
    proc = start_ignoring_sigint(demo_launch_cmd(tmp_path, "sig", *args), out)
    try:
        # a learner step: every child is up, so the stop below is the run's whole orderly stop
        trained = lambda: any("learner/version" in r for r in read_metrics(run_dir / "metrics.jsonl"))  # noqa: E731
        wait_until(trained, 300, "a learner step", proc, out)
        assert not ignores(proc.pid, signal.SIGINT), "the launcher kept the SIGINT it inherited ignored"
        info = json.loads((run_dir / "run.json").read_text())
        for name, pid in info["pids"].items():  # nor does any process it started inherit that
            assert not ignores(pid, signal.SIGINT), name
        stop(proc, sig, out)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert proc.returncode == EXIT_CODES[sig], text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    pids = [*info["pids"].values(), info["redis_pid"]]
    assert not [p for p in pids if pid_alive(p)], "processes left running"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == REASONS[sig] and summary["final_version"] >= 1


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.vllm
def test_a_joined_generator_started_ignoring_sigint_leaves_cleanly_on_ctrl_c(tmp_path):
    """``asyncrl generator``: Ctrl-C is its clean leave, as SIGTERM is (slots given back at once, exit 0)."""
    pytest.importorskip("vllm")
    run_dir, out, joined_out, log = (
        tmp_path / "join",
        tmp_path / "launcher.out",
        tmp_path / "joined.out",
        tmp_path / "g.log",
    )
    args = ("--generators", "0", "--learners", "1", "--steps", "10000", "--set", "run.eval_every=0")
    launcher = start_ignoring_sigint(demo_launch_cmd(tmp_path, "join", *args), out)
    joined = None
    try:
        wait_until(lambda: (run_dir / "run.json").exists(), 300, "the run", launcher, out)
        cmd = [sys.executable, "-m", "asyncrl.cli", "generator", "--run", str(run_dir), "--id", "joined-a"]
        joined = start_ignoring_sigint([*cmd, "--log-file", str(log)], joined_out)
        serving = lambda: log.exists() and "generator joined-a up" in log.read_text()  # noqa: E731
        wait_until(serving, 300, "the joined generator", joined, joined_out)
        wait_until(lambda: 1 in fleet_sizes(run_dir), 60, "the launcher to see it", launcher, out)
        stop(joined, signal.SIGINT, joined_out)
        assert joined.returncode == 0, joined_out.read_text()[-3000:]
        wait_until(lambda: fleet_sizes(run_dir)[-1] == 0, 60, "the launcher to see it leave", launcher, out)
        stop(launcher, signal.SIGINT, out)
    finally:
        for proc in (joined, launcher):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert launcher.returncode == 130, out.read_text()[-3000:]
    text = out.read_text()  # whole now (the launcher's log lines may wait for its live line to end)
    assert "(joined-a left)" in text and "joined-a stopped renewing its lease" not in text  # a leave, no expiry


@pytest.mark.redis
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_asyncrl_redis_started_ignoring_sigint_stops_on_either_signal(tmp_path, sig, monkeypatch):
    """The lightest role command that documents a stop: the server it started goes with it."""
    require_redis_binary()
    out = tmp_path / "out"
    monkeypatch.setenv("ASYNCRL_SECRET", "5e" * 32)
    cmd = [sys.executable, "-m", "asyncrl.cli", "redis", "--dir", str(tmp_path / "redis")]
    proc = start_ignoring_sigint(cmd, out)
    try:
        wait_until(lambda: "listening on" in out.read_text(), 60, "the server", proc, out)
        server = int(out.read_text().split("(pid ")[1].split(")")[0])
        stop(proc, sig, out)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out.read_text()
    assert not pid_alive(server)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_asyncrl_sft_started_ignoring_sigint_stops_its_ranks_with_130_or_143(tmp_path, sig):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "asyncrl.cli", "sft", "--config", "configs/sort-sft.yaml", "--name", "s",
           "--set", f"run.out_dir={tmp_path}", "--steps", "100000"]  # fmt: skip
    proc = start_ignoring_sigint(cmd, out)
    try:
        wait_until(lambda: "rank(s)" in out.read_text() and children_of(proc.pid), 300, "the ranks", proc, out)
        ranks = children_of(proc.pid)
        stop(proc, sig, out)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_CODES[sig], out.read_text()[-3000:]
    assert "Traceback" not in out.read_text()
    assert not [p for p in ranks if pid_alive(p)], "ranks left running"
