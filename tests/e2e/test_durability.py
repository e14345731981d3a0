"""Nothing is lost when the run's redis-server or a learner rank dies mid-run (through the CLI).

One demo run loses its redis-server and then a learner rank to SIGKILL; the launcher recovers from both. The
summary's buffer counters must then balance: every group pushed is trained, dropped as stale,
filtered, dead, or still in the buffer (``lost == 0``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest
from demo_launch import ROOT, demo_launch_cmd
from test_supervision import latest_version, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]

STEPS = 24


def launch(tmp_path, name: str, *args: str) -> subprocess.Popen:
    cmd = demo_launch_cmd(
        tmp_path, name, "--generators", "2", "--learners", "2", "--steps", str(STEPS),
        "--set", "run.eval_every=0", "--set", "learner.checkpoint_every=5", *args,
    )  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout_s: float = 400) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out


def plain(out: str) -> str:
    """The launcher's log as one line: rich wraps long lines and puts ``file.py:N`` at the right."""
    return " ".join(re.sub(r"\S+\.py:\d+", " ", out).split())


def check_balanced(summary: dict) -> dict:
    b = summary["buffer"]
    accounted = b["trained"] + b["dropped_stale"] + b["filtered"] + b["dead"] + b["queued"] + b["pending"]
    assert b["pushed"] == accounted and b["lost"] == 0, b
    assert b["trained"] >= STEPS * 8 // 2, "at least half the steps' groups trained once"
    return b


def test_redis_then_a_learner_killed_mid_run_lose_nothing(tmp_path):
    """One run, two deaths: its redis-server at version 8 (every client reconnects by itself), then learner
    rank 1 at version 12 (every rank restarts from the last committed checkpoint)."""
    pytest.importorskip("vllm")
    run_dir = tmp_path / "kill"
    proc = launch(tmp_path, "kill")
    wait_for(lambda: latest_version(run_dir) >= 8, 300, "version 8", proc)
    info = json.loads((run_dir / "run.json").read_text())
    os.kill(info["redis_pid"], signal.SIGKILL)
    wait_for(lambda: latest_version(run_dir) >= 12, 300, "version 12 after redis-server's restart", proc)
    restarted = json.loads((run_dir / "run.json").read_text())
    assert restarted["redis_pid"] != info["redis_pid"]
    os.kill(restarted["pids"]["learner-1"], signal.SIGKILL)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["final_version"] == STEPS
    assert summary["restarts"] == {"generators": 0, "learners": 1, "redis": 1}, "generators reconnect by themselves"
    said = plain(out)
    assert "redis-server died; restarting it" in said
    restart = re.search(r"restarting every learner rank from version (\d+)", said)
    assert restart and int(restart.group(1)) in (10, 15, 20), out[-3000:]
    b = check_balanced(summary)
    assert b["started"] >= b["pushed"]
    # the versions went back to the checkpoint and forward again to the end
    versions = [
        json.loads(line)["learner/version"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"learner/version"' in line
    ]
    assert versions[-1] == STEPS
    back = [b for a, b in zip(versions, versions[1:], strict=False) if b <= a]
    assert back and back[0] - 1 == int(restart.group(1)), versions
    assert (run_dir / "export" / "config.json").is_file()
