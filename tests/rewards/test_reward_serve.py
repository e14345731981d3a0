"""``asyncrl reward-serve`` as a real process: the protocol, the hard deadline, auth, loopback.

A "hung" item sleeps an hour against a 1 s deadline: tests assert on what the server answers and
which worker answers next, never on how long anything took. Every server a test starts is stopped
by its pid at teardown.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from asyncrl.rewards.remote import SCHEMA, TOKEN_ENV, VERSION

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
READY_TIMEOUT_S = 120.0  # a server and its workers start in a few seconds; a loaded CI machine is slower


# ----- reward functions the servers import (as test_reward_serve:<name>) -------------------------


def pid_reward(prompt: str, completion: str, record: dict):
    """The answering worker's pid; a record's flags make it hang, die, raise or misbehave."""
    print("a reward that prints to stdout")  # must not corrupt the worker channel
    if record.get("hang"):
        time.sleep(3600)
    if record.get("die"):
        os._exit(3)
    if record.get("raise"):
        raise ValueError("a bad item")
    if record.get("text"):
        return "not a number"
    if record.get("calls"):
        with open(record["calls"], "a") as f:
            f.write(completion + "\n")
    if record.get("parts"):
        return {"pid": float(os.getpid()), "length": float(len(completion))}
    return float(os.getpid())


# ----- helpers shared with test_remote_reward.py and test_math_reward.py ------------------------


@dataclass
class Served:
    """A running ``asyncrl reward-serve``: its process, URL (no token), token and output."""

    proc: subprocess.Popen
    url: str
    token: str
    token_file: Path | None
    stdout: list[str] = field(default_factory=list)
    stderr_path: Path | None = None
    pump: threading.Thread | None = None  # reads the server's stdout into ``stdout``

    @property
    def token_url(self) -> str:
        return self.url.replace("http://", f"http://:{self.token}@", 1)

    def post(self, body: dict | bytes, token: str | None = None, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token if token is None else token}"}
        headers.update(kwargs.pop("headers", {}))
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url, content=content, headers=headers, timeout=60, **kwargs)

    def stop(self) -> None:
        """SIGTERM by pid, then SIGKILL if it does not exit."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.pump is not None:
            self.pump.join(10)  # it ends at the pipe's EOF, once the server is gone
        self.proc.stdout.close()

    def output(self) -> str:
        err = self.stderr_path.read_text(errors="replace") if self.stderr_path else ""
        return "\n".join(self.stdout) + "\n" + err


def serve_env() -> dict[str, str]:
    """The environment of a test server: tests/ importable, no token from the caller's environment."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    here = str(Path(__file__).resolve().parent)  # the rewards these tests serve live in tests/rewards/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, str(TESTS), env.get("PYTHONPATH", "")) if p)
    return env


def start_reward_serve(workdir: Path, reward: str, *args: str, token_file: bool = True) -> Served:
    """Start ``asyncrl reward-serve --reward REWARD ARGS`` on a free loopback port; wait until ready."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "token" if token_file else None
    cmd = [sys.executable, "-m", "asyncrl.cli", "reward-serve", "--reward", reward, "--port", "0", *args]
    if path is not None:
        cmd += ["--token-file", str(path)]
    stderr_path = workdir / "serve.stderr"
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=serve_env(), cwd=REPO, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    served = Served(proc, "", "", path, stderr_path=stderr_path, pump=threading.Thread(target=pump, daemon=True))
    served.pump.start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while not served.token:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"reward-serve exited ({proc.wait()}):\n{served.output()}")
            served.stdout.append(line)
            if " at http://" in line:
                served.url = line.split(" at ", 1)[1].split()[0]
            if "token in " in line:
                served.token = Path(line.split("token in ", 1)[1].split(";")[0]).read_text().strip()
    except BaseException:
        served.stop()
        raise
    return served


def request(rid: str | None = None, completion: str = "abc", **record) -> dict:
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "id": rid or uuid.uuid4().hex,
        "prompt": "p",
        "completion": completion,
        "record": record,
    }


# ----- tests --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """One worker, a 1 s deadline: which pid answers shows whether the worker was replaced."""
    server = start_reward_serve(
        tmp_path_factory.mktemp("serve"), "test_reward_serve:pid_reward", "--workers", "1", "--deadline-s", "1"
    )
    yield server
    server.stop()


def answer(served: Served, **record) -> dict:
    body = request(**record)
    resp = served.post(body)
    assert resp.status_code == 200, resp.text
    got = resp.json()
    assert (got["schema"], got["version"], got["id"]) == (SCHEMA, VERSION, body["id"])
    return got


def test_answers_rewards_parts_and_errors(served: Served):
    assert answer(served)["reward"] > 0  # a pid
    assert answer(served, completion="abcd", parts=True)["parts"]["length"] == 4.0
    failed = answer(served, **{"raise": True})
    assert failed["cause"] == "reward_error" and "ValueError: a bad item" in failed["error"]
    assert answer(served, text=True)["cause"] == "reward_invalid"


def test_hung_item_is_killed_and_its_worker_replaced(served: Served):
    before = answer(served)["reward"]
    hung = answer(served, hang=True)
    assert hung["cause"] == "reward_timeout" and "deadline" in hung["error"]
    after = answer(served)["reward"]  # the one worker's replacement answers
    assert after != before
    assert not psutil.pid_exists(int(before))
    died = answer(served, die=True)  # a worker that dies mid-item is replaced too
    assert died["cause"] == "reward_error" and "exited with code 3" in died["error"]
    assert answer(served)["reward"] not in (before, after)


def test_repeated_id_is_answered_from_the_cache(served: Served, tmp_path: Path):
    calls = tmp_path / "calls"
    body = request(calls=str(calls))
    first, second = served.post(body), served.post(body)
    assert first.status_code == second.status_code == 200
    assert first.json() == second.json()
    assert calls.read_text().splitlines() == ["abc"]  # computed once
    other = {**body, "completion": "something else"}
    assert served.post(other).status_code == 409


def test_auth_is_required(served: Served):
    body = request()
    assert served.post(body, token="wrong").status_code == 401
    assert httpx.post(served.url, json=body, timeout=60).status_code == 401
    assert httpx.post(served.url, json=body, auth=("", served.token), timeout=60).status_code == 401  # Basic
    assert served.post(body).status_code == 200


def test_bad_requests_are_400(served: Served):
    assert served.post(b"not json").status_code == 400
    wrong_version = served.post({**request(), "version": 2})
    assert wrong_version.status_code == 400 and "version 1" in wrong_version.json()["error"]
    assert served.post({k: v for k, v in request().items() if k != "record"}).status_code == 400
    assert served.post({**request(), "id": ""}).status_code == 400


def test_loopback_by_default_and_token_never_printed(served: Served):
    assert served.url.startswith("http://127.0.0.1:")
    listening = [c for c in psutil.Process(served.proc.pid).net_connections("tcp") if c.status == "LISTEN"]
    assert listening and {c.laddr.ip for c in listening} == {"127.0.0.1"}
    assert served.token_file.stat().st_mode & 0o777 == 0o600
    assert served.token not in served.output()


def test_generated_token_file_is_private_and_stop_cleans_up(tmp_path: Path):
    server = start_reward_serve(tmp_path, "test_reward_serve:pid_reward", "--workers", "1", token_file=False)
    try:
        path = Path(server.stdout[-1].split("token in ", 1)[1].split(";")[0])
        assert path.stat().st_mode & 0o777 == 0o600
        assert server.token not in server.output()
        worker = server.post(request()).json()["reward"]
    finally:
        server.stop()
    assert server.proc.returncode == 143  # stopped by SIGTERM (128 + 15), as documented
    assert not path.exists()  # the temporary token file goes with the server
    assert not psutil.pid_exists(int(worker))  # and so do its workers


def test_unimportable_reward_fails_fast_with_one_line(tmp_path: Path):
    cmd = [sys.executable, "-m", "asyncrl.cli", "reward-serve", "--reward", "no_such_module:f", "--workers", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=serve_env(), cwd=REPO, timeout=120)
    assert done.returncode == 2
    assert "cannot import 'no_such_module:f'" in done.stderr and "Traceback" not in done.stderr
