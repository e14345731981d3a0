"""``asyncrl env-serve`` as a real process and :class:`RemoteEnv` against it: sessions, the answer cache,
leases, hostile requests, hung and killed workers, a restart.

The served environments (``env_serve_fixtures``) log every step they really ran to a file, so a test
sees what the server did, not just what it answered. A "hung" step sleeps an hour against a 1 s
deadline; tests poll for outcomes with generous deadlines and never assert on durations. Every server
a test starts is stopped by its pid.
"""

from __future__ import annotations

import asyncio
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

from asyncrl.episodes import remote_env
from asyncrl.episodes.remote_env import SCHEMA, TOKEN_ENV, VERSION, RemoteEnv
from asyncrl.errors import EpisodeFailure, UserError

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
READY_TIMEOUT_S = 120.0  # a server and its first worker start in seconds; a loaded CI machine is slower
PLAIN, ASYNC = "env_serve_fixtures:CountingEnv", "env_serve_fixtures:AsyncCountingEnv"


@dataclass
class EnvServer:
    """A running ``asyncrl env-serve``: its process, URL (no token), token and output."""

    proc: subprocess.Popen
    workdir: Path
    url: str = ""
    token: str = ""
    stdout: list[str] = field(default_factory=list)

    @property
    def token_url(self) -> str:
        return self.url.replace("http://", f"http://:{self.token}@", 1)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def post(self, path: str, body: dict | bytes, token: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token if token is None else token}"} if token != "" else {}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url + path, content=content, headers=headers, timeout=60)

    def health(self) -> dict:
        resp = httpx.get(self.url + "/health", headers={"Authorization": f"Bearer {self.token}"}, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """``sig`` by pid, then SIGKILL if it does not exit; its exit code."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def output(self) -> str:
        return "\n".join(self.stdout) + "\n" + (self.workdir / "serve.stderr").read_text(errors="replace")


def start_env_serve(workdir: Path, env: str, *args: str, port: int = 0) -> EnvServer:
    """``asyncrl env-serve --env ENV ARGS`` on a loopback port (0: a free one); returns once it is ready."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "asyncrl.cli", "env-serve", "--env", env, "--port", str(port)]
    cmd += ["--token-file", str(workdir / "token"), *args]
    environ = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), environ.get("PYTHONPATH", "")) if p)
    with open(workdir / "serve.stderr", "ab") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=environ, cwd=REPO, text=True)
    server, lines = EnvServer(proc, workdir), queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while not server.token:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"env-serve exited ({proc.wait()}):\n{server.output()}")
            server.stdout.append(line)
            if " at http://" in line:
                server.url = line.split(" at ", 1)[1].split()[0]
            if "token in " in line:
                server.token = (workdir / "token").read_text().strip()
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server


def message(**fields) -> dict:
    return {"schema": SCHEMA, "version": VERSION, "id": uuid.uuid4().hex, **fields}


def open_session(server: EnvServer, **options) -> str:
    resp = server.post("/sessions", message(options=options))
    assert resp.status_code == 200, resp.text
    return resp.json()["session"]


def steps_logged(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def wait_until(what: str, check, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.1)


def failure_of(coro) -> EpisodeFailure:
    with pytest.raises(EpisodeFailure) as failed:
        asyncio.run(coro)
    return failed.value


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """Two workers, the async twin served: most protocol tests need nothing else."""
    s = start_env_serve(tmp_path_factory.mktemp("env-serve"), ASYNC, "--workers", "2", "--deadline-s", "20")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory):
    s = start_env_serve(tmp_path_factory.mktemp("env-serve-plain"), PLAIN, "--workers", "1")
    yield s
    s.stop()


# ----- sessions ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["plain", "async"])
def test_reset_step_close_round_trip(kind, server: EnvServer, plain_server: EnvServer, tmp_path: Path):
    served = plain_server if kind == "plain" else server
    log = tmp_path / "log"

    async def episode():
        env = RemoteEnv(served.token_url, options={"log": str(log), "turns": 2}, timeout_s=60)
        first = await env.reset({"name": "t1"}, 7)
        steps = [await env.step("a"), await env.step("b")]
        await env.close()
        await env.close()  # idempotent
        return first, steps

    first, steps = asyncio.run(episode())
    assert first.startswith(("reset t1 seed 7", "async reset t1 seed 7"))
    assert first.startswith("async") == (kind == "async")
    assert [s[:3] for s in steps] == [("step 1 of t1", 1.0, False), ("step 2 of t1", 1.0, True)]
    assert steps[0][3]["n"] == 1 and steps[0][3]["pid"] != served.proc.pid  # never in the server itself
    assert steps_logged(log) == ["step t1 1 a", "step t1 2 b", "close t1"]
    health = served.health()
    assert health["opened"] >= 1 and health["closed"] >= 1 and health["steps"] >= 2
    assert not remote_env._SHARED  # the loop's HTTP session closed with asyncio.run


def test_two_sessions_do_not_share_state(server: EnvServer):
    async def two():
        a, b = RemoteEnv(server.token_url, timeout_s=60), RemoteEnv(server.token_url, timeout_s=60)
        await asyncio.gather(a.reset({"name": "a"}, 1), b.reset({"name": "b"}, 2))
        assert len(remote_env._SHARED) == 1  # one HTTP session for every RemoteEnv of the loop
        got = [await a.step("x"), await a.step("x"), await b.step("x"), await a.step("x")]
        assert a.session != b.session
        await asyncio.gather(a.close(), b.close())
        return [obs for obs, *_ in got]

    assert asyncio.run(two()) == ["step 1 of a", "step 2 of a", "step 1 of b", "step 3 of a"]


def test_a_retried_id_is_answered_once_and_another_body_under_it_is_409(server: EnvServer, tmp_path: Path):
    log = tmp_path / "log"
    sid = open_session(server, log=str(log))
    assert server.post(f"/sessions/{sid}/reset", message(task={"name": "r"}, seed=0)).status_code == 200
    step = message(action="a")
    first, again = server.post(f"/sessions/{sid}/step", step), server.post(f"/sessions/{sid}/step", step)
    assert first.status_code == again.status_code == 200 and first.json() == again.json()
    slow = message(action="slow")  # retries that arrive while the first still computes await it
    answers: list[httpx.Response] = []
    senders = [
        threading.Thread(target=lambda: answers.append(server.post(f"/sessions/{sid}/step", slow))) for _ in "ab"
    ]
    for t in senders:
        t.start()
    for t in senders:
        t.join(60)
    assert len(answers) == 2 and answers[0].json() == answers[1].json()
    assert answers[0].json()["info"]["n"] == 2
    assert steps_logged(log) == ["step r 1 a", "step r 2 slowed"]  # each stepped once
    other = server.post(f"/sessions/{sid}/step", {**step, "action": "b"})
    assert other.status_code == 409 and "different request" in other.json()["error"]
    open_again = server.post(
        "/sessions", {**message(options={}), "id": step["id"]}
    )  # an id is one request, whatever the path
    assert open_again.status_code == 409
    closing = message()
    assert (
        server.post(f"/sessions/{sid}/close", closing).json() == server.post(f"/sessions/{sid}/close", closing).json()
    )
    assert steps_logged(log)[-1] == "close r" and steps_logged(log).count("close r") == 1


def test_environment_errors_are_answers_and_the_session_goes_on(server: EnvServer):
    async def broken():
        env = RemoteEnv(server.token_url, timeout_s=60)
        await env.reset({"name": "e"}, 0)
        with pytest.raises(EpisodeFailure) as failed:
            await env.step("raise")
        assert failed.value.cause == "env_error" and "ValueError: the environment broke" in failed.value.detail
        after = await env.step("fine")  # env_error leaves the session as it was
        await env.close()
        return after

    assert asyncio.run(broken())[0] == "step 1 of e"
    sid = open_session(server)
    assert server.post(f"/sessions/{sid}/step", message(action="x")).json()["cause"] == "env_error"  # before reset


def test_a_constructor_that_raises_is_env_error(tmp_path: Path):
    served = start_env_serve(tmp_path, "env_serve_fixtures:BrokenInit", "--workers", "1")
    try:
        failure = failure_of(RemoteEnv(served.token_url, options={"x": 1}, timeout_s=60).reset({}, 0))
        assert failure.cause == "env_error" and "cannot build with ['x']" in failure.detail
    finally:
        served.stop()


def test_an_idle_session_expires_its_env_closed(tmp_path: Path):
    served = start_env_serve(tmp_path, PLAIN, "--workers", "1", "--lease-s", "1")
    log = tmp_path / "log"
    try:
        env = RemoteEnv(served.token_url, options={"log": str(log)}, timeout_s=60)

        async def start():
            await env.reset({"name": "idle"}, 0)
            await env.step("a")

        asyncio.run(start())
        wait_until("expiry", lambda: "close idle" in steps_logged(log))
        assert served.health()["expired"] == 1 and served.health()["sessions"] == 0
        assert failure_of(env.step("b")).cause == "env_lost"
        assert served.health()["pool"]["sessions_open"] == 0  # its worker slot freed
    finally:
        served.stop()


# ----- hostile requests --------------------------------------------------------------------------------


def test_bad_requests_are_4xx_and_leave_the_server_answering(server: EnvServer):
    sid = open_session(server)
    deep = b'{"schema": "asyncrl.env", "version": 1, "id": "d", "options": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nested = json.loads("[" * 500 + "]" * 500)
    cases = {
        "no token": (lambda: server.post("/sessions", message(options={}), token=""), 401),
        "wrong token": (lambda: server.post(f"/sessions/{sid}/step", message(action="a"), token="no"), 401),
        "health without token": (lambda: httpx.get(server.url + "/health", timeout=60), 401),
        "unknown session": (lambda: server.post("/sessions/0000/step", message(action="a")), 404),
        "unknown operation": (lambda: server.post(f"/sessions/{sid}/jump", message()), 404),
        "huge body": (lambda: server.post(f"/sessions/{sid}/step", b'{"a": "' + b"x" * (33 * 2**20) + b'"}'), 413),
        "100k levels deep": (lambda: server.post("/sessions", deep), 400),
        "500 levels deep": (lambda: server.post(f"/sessions/{sid}/reset", message(task={"x": nested}, seed=0)), 400),
        "unknown field": (lambda: server.post(f"/sessions/{sid}/step", message(action="a", temperature=1)), 400),
        "missing field": (lambda: server.post(f"/sessions/{sid}/reset", message(task={})), 400),
        "wrong type": (lambda: server.post(f"/sessions/{sid}/reset", message(task={}, seed="0")), 400),
        "other version": (lambda: server.post("/sessions", {**message(options={}), "version": 2}), 400),
        "not JSON": (lambda: server.post("/sessions", b"{not json"), 400),
    }
    for name, (send, status) in cases.items():
        resp = send()
        assert resp.status_code == status, (name, resp.status_code, resp.text[:300])
        assert server.health()["schema"] == SCHEMA, name
    unknown = server.post(f"/sessions/{sid}/step", message(action="a", temperature=1, extra=2)).json()["error"]
    assert "'extra'" in unknown and "'temperature'" in unknown
    assert "nested" in server.post("/sessions", deep).json()["error"]
    assert failure_of(RemoteEnv(server.token_url.replace(server.token, "wrong"), timeout_s=60).reset({}, 0)).cause == (
        "env_error"
    )


def test_loopback_by_default_private_token_file_never_printed(server: EnvServer):
    assert server.url.startswith("http://127.0.0.1:")
    listening = [c for c in psutil.Process(server.proc.pid).net_connections("tcp") if c.status == "LISTEN"]
    assert listening and {c.laddr.ip for c in listening} == {"127.0.0.1"}
    assert (server.workdir / "token").stat().st_mode & 0o777 == 0o600
    assert server.token not in server.output()


# ----- faults ------------------------------------------------------------------------------------------


def children(pid: int) -> set[int]:
    """The processes whose parent is ``pid``, from /proc."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


@pytest.fixture
def faulty(tmp_path: Path):
    s = start_env_serve(tmp_path, PLAIN, "--workers", "2", "--deadline-s", "1")
    yield s
    s.stop()


def test_a_hanging_step_is_env_timeout_and_the_server_goes_on(faulty: EnvServer):
    async def hang():
        env = RemoteEnv(faulty.token_url, timeout_s=60)
        await env.reset({"name": "h"}, 0)
        with pytest.raises(EpisodeFailure) as failed:
            await env.step("hang")
        assert failed.value.cause == "env_timeout" and "killed" in failed.value.detail
        with pytest.raises(EpisodeFailure) as again:
            await env.step("a")  # the session went with its worker
        assert again.value.cause == "env_lost"
        await env.close()  # nothing left to close: no error
        assert await env.reset({"name": "again"}, 1) is not None  # a new session for the same RemoteEnv
        await env.close()
        fresh = RemoteEnv(faulty.token_url, timeout_s=60)
        await fresh.reset({"name": "f"}, 0)
        return await fresh.step("a")

    assert asyncio.run(hang())[0] == "step 1 of f"
    health = faulty.health()
    assert health["faults"]["env_timeout"] == 1 and health["pool"]["timeouts"] == 1


def test_no_answer_within_the_clients_timeout_is_env_timeout_and_close_still_closes(faulty: EnvServer):
    async def impatient():
        env = RemoteEnv(faulty.token_url, timeout_s=60)
        await env.reset({"name": "i"}, 0)
        env.timeout_s = 0.3  # under the server's 1 s deadline: the client gives up first
        with pytest.raises(EpisodeFailure) as failed:
            await env.step("hang")
        env.timeout_s = 60
        await env.close()  # waits behind the hung step, which the server's deadline ends
        return failed.value

    failure = asyncio.run(impatient())
    assert failure.cause == "env_timeout" and "no answer from" in failure.detail
    health = faulty.health()
    assert health["sessions"] == 0 and health["closed"] == 1 and health["faults"] == {"env_timeout": 1}


def test_killing_one_worker_fails_only_its_sessions(faulty: EnvServer):
    async def play():
        envs = [RemoteEnv(faulty.token_url, timeout_s=60) for _ in range(2)]
        for i, env in enumerate(envs):
            await env.reset({"name": str(i)}, i)
        pids = [(await env.step("a"))[3]["pid"] for env in envs]
        assert len(set(pids)) == 2, "two sessions, two workers"
        assert set(pids) <= children(faulty.proc.pid)
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(EpisodeFailure) as failed:
            await envs[0].step("b")
        assert failed.value.cause in ("env_crash", "env_lost") and "SIGKILL" in failed.value.detail
        assert (await envs[1].step("b"))[0] == "step 2 of 1"  # the other worker's session goes on
        for env in envs:
            await env.close()

    asyncio.run(play())
    assert faulty.health()["pool"]["crashes"] == 1


def test_a_restarted_server_loses_old_sessions_and_serves_new_ones(tmp_path: Path):
    log = tmp_path / "log"
    first = start_env_serve(tmp_path, PLAIN, "--workers", "1")
    env = RemoteEnv(first.token_url, options={"log": str(log)}, timeout_s=60)
    try:
        asyncio.run(env.reset({"name": "old"}, 0))
        workers = children(first.proc.pid)
    finally:
        code = first.stop(signal.SIGINT)
    assert code == 130, first.output()  # 128 + SIGINT, after closing the session and killing its workers
    assert steps_logged(log) == ["close old"] and not any(psutil.pid_exists(p) for p in workers)
    assert "Traceback" not in first.output()
    second = start_env_serve(tmp_path, PLAIN, "--workers", "1", port=first.port)
    try:
        assert second.url == first.url and second.token == first.token  # the same token file
        assert failure_of(env.step("a")).cause == "env_lost"

        async def new_episode():
            fresh = RemoteEnv(second.token_url, timeout_s=60)
            await fresh.reset({"name": "new"}, 0)
            step = await fresh.step("a")
            await fresh.close()
            return step

        assert asyncio.run(new_episode())[0] == "step 1 of new"
    finally:
        assert second.stop() == 143  # 128 + SIGTERM


def test_an_unimportable_env_fails_fast_with_one_line():
    cmd = [sys.executable, "-m", "asyncrl.cli", "env-serve", "--env", "no_such_module:Env", "--workers", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "cannot serve 'no_such_module:Env'" in done.stderr and "Traceback" not in done.stderr
    cmd[5] = "asyncrl.demo.guess:reward"  # importable, but a function
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2 and "not an environment class" in done.stderr, done.stderr


# ----- the client alone --------------------------------------------------------------------------------


def test_an_unreachable_server_is_env_error_naming_the_url_not_the_token():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    env = RemoteEnv(f"http://:sekrit@127.0.0.1:{port}", timeout_s=1.5)
    failure = failure_of(env.reset({}, 0))
    assert failure.cause == "env_error" and f"127.0.0.1:{port}" in failure.detail
    assert "sekrit" not in failure.detail and "sekrit" not in repr(env)
    assert "attempt" in failure.detail  # it retried before giving up


def test_the_token_comes_from_the_url_or_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(UserError, match=TOKEN_ENV):
        RemoteEnv("http://127.0.0.1:9")
    with pytest.raises(UserError, match="not an http"):
        RemoteEnv("ftp://:t@127.0.0.1:9")
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert RemoteEnv("http://127.0.0.1:9")._token == "from-env"
    assert RemoteEnv("http://:from%2Furl@127.0.0.1:9")._token == "from/url"
