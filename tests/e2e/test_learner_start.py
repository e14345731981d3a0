"""A learner's start through the CLI: a rank that waits past ``learner.start_timeout_s`` is reported by the
launcher in one line naming what it waits for, and the lock file a killed build of DeepSpeed's CPU op left
behind never blocks a launch (before, every later launch hung on it, silently, for good)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from demo_launch import ROOT, demo_launch_cmd
from test_supervision import wait_for

from asyncrl.learners import ops
from asyncrl.lifetime import torch_extensions_dir

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]

OP = "deepspeed_shm_comm"


def _extensions_with_lock(tmp_path: Path) -> Path:
    """A copy of the environment's built op (``scripts/setup.sh`` built it) with a build's lock file in it."""
    built = torch_extensions_dir() / OP
    assert (built / f"{OP}.so").is_file(), "scripts/setup.sh builds the op"
    root = tmp_path / "extensions"
    shutil.copytree(built, root / OP)
    (root / OP / "lock").touch()
    return root


def test_a_stuck_learner_is_reported_and_a_stale_build_lock_does_not_block_the_launch(tmp_path):
    pytest.importorskip("vllm")
    root = _extensions_with_lock(tmp_path)
    builder = subprocess.Popen(["sleep", "600"], cwd=root / OP)  # a build that runs: the lock is not stale yet
    run_dir, out_path = tmp_path / "start", tmp_path / "launcher.out"
    cmd = demo_launch_cmd(tmp_path, "start", "--generators", "1", "--learners", "1", "--steps", "3",
                          "--set", "run.eval_every=0", "--set", "learner.start_timeout_s=5")  # fmt: skip
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "COLUMNS": "400"}
    with out_path.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_for(lambda: "are not up" in out_path.read_text(), 180, "the launcher's report", proc, run_dir)
        (line,) = [x for x in out_path.read_text().splitlines() if "are not up" in x]
        assert "the learner ranks are not up" in line and f"learner-0: waiting for {root / OP / 'lock'}" in line
        builder.kill()  # the build "dies" and leaves its lock file: the rank goes on past it
        builder.wait()
        assert proc.wait(timeout=300) == 0, out_path.read_text()
    finally:
        builder.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (root / OP / "lock").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_version"] == 3, summary
    log = (run_dir / "logs" / "learner-0.log").read_text()
    assert "left by a build that was killed" in log
    assert (root / ops.LOCK_NAME).exists()  # ours: a flock's file, never in the way


def test_a_launch_after_a_build_killed_mid_way_completes(tmp_path):
    """The state a Ctrl-C during a first launch's op build leaves (torch's lock file, no builder): the next
    launch removes it and completes."""
    pytest.importorskip("vllm")
    root = _extensions_with_lock(tmp_path)
    cmd = demo_launch_cmd(tmp_path, "after", "--generators", "1", "--learners", "2", "--steps", "2",
                          "--set", "run.eval_every=0")  # fmt: skip
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not (root / OP / "lock").exists()
    assert json.loads((tmp_path / "after" / "summary.json").read_text())["final_version"] == 2
