"""``asyncrl reward-serve`` at its edges, as a real process: hostile bodies, a body that never arrives in
full, fields the protocol does not know, and the signals that stop it (also when started, as a
background job is, with SIGINT ignored).

Outcomes decide every test: a status code, a closed connection, an exit code. The socket timeouts
below only bound how long a broken server can hold a test; the server's own read deadline is seconds.
Every server a test starts is stopped by its pid.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from asyncrl.rewards.remote import SCHEMA, TOKEN_ENV, VERSION

ROOT = Path(__file__).resolve().parents[2]
REWARD = "asyncrl.demo.sort:reward"  # light, in the package: no test module on the workers' path
READY_TIMEOUT_S = 120.0  # a server and its worker start in seconds; a loaded CI machine is slower
SOCKET_TIMEOUT_S = 60.0  # a bound on a broken server, far past the server's read deadline


@dataclass
class Server:
    proc: subprocess.Popen
    url: str = ""
    token: str = ""
    lines: list[str] = field(default_factory=list)  # its output up to the URL
    more: queue.Queue | None = None  # its output after that, then None at its end

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname, parts.port

    def post(self, content: bytes) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        return httpx.post(self.url, content=content, headers=headers, timeout=SOCKET_TIMEOUT_S)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def start(tmp_path: Path, ignore_sigint: bool = False) -> Server:
    """``asyncrl reward-serve`` with one worker, its output on a pipe; returns once it printed its URL."""
    token_file = tmp_path / "token"
    cmd = [sys.executable, "-m", "asyncrl.cli", "reward-serve", "--reward", REWARD, "--workers", "1"]
    cmd += ["--port", "0", "--token-file", str(token_file)]
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}

    def background_job() -> None:  # what a non-interactive shell does to `cmd &`
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=ROOT,
        preexec_fn=background_job if ignore_sigint else None,
    )
    server = Server(proc)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while not server.url:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"reward-serve exited ({proc.wait()}):\n" + "\n".join(server.lines))
            server.lines.append(line)
            if " at http://" in line:
                server.url = line.split(" at ", 1)[1].split()[0]
        server.token = token_file.read_text().strip()
    except BaseException:
        server.stop()
        raise
    server.more = lines
    return server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start(tmp_path_factory.mktemp("edges"))
    yield s
    s.stop()


def request(**extra) -> dict:
    body = {"schema": SCHEMA, "version": VERSION, "id": uuid.uuid4().hex, "prompt": "sort:ba=", "completion": "ab"}
    return {**body, "record": {"answer": "ab"}, **extra}


def test_a_sound_request_is_answered(server: Server):
    resp = server.post(json.dumps(request()).encode())
    assert resp.status_code == 200 and "reward" in resp.json(), resp.text


def test_a_body_nested_100k_levels_deep_is_a_bad_request(server: Server):
    deep = b"[" * 100_000 + b"]" * 100_000
    resp = server.post(deep)
    assert resp.status_code == 400, resp.text  # not 500: a client retries a 5xx
    assert "nested" in resp.json()["error"]
    deep_record = json.dumps(request(record={"answer": "ab", "x": json.loads("[" * 500 + "]" * 500)})).encode()
    resp = server.post(deep_record)  # parses, yet deeper than any dataset record: refused the same way
    assert resp.status_code == 400 and "nested" in resp.json()["error"], resp.text
    assert server.post(json.dumps(request()).encode()).status_code == 200  # the server is unharmed


def test_unknown_fields_are_refused_by_name(server: Server):
    resp = server.post(json.dumps(request(temperature=0.7, extra="x")).encode())
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert "'extra'" in error and "'temperature'" in error


def test_a_body_shorter_than_its_content_length_gets_408_or_a_close(server: Server):
    body = json.dumps(request()).encode()
    head = (
        f"POST /score HTTP/1.1\r\nHost: {server.address[0]}\r\nAuthorization: Bearer {server.token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body) + 1000}\r\n\r\n"
    ).encode()
    with socket.create_connection(server.address, timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(head + body)  # 1000 bytes short, and the connection left open
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except TimeoutError:
            pytest.fail(f"no answer and no close in {SOCKET_TIMEOUT_S:g} s; got {reply[:200]!r}")
    assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert server.post(json.dumps(request()).encode()).status_code == 200


def wait_exit(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("reward-serve did not exit on the signal")


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signals_stop_it_with_their_exit_codes_even_when_sigint_was_ignored(tmp_path: Path, sig, code):
    s = start(tmp_path, ignore_sigint=True)
    try:
        assert s.post(json.dumps(request()).encode()).status_code == 200
        os.kill(s.proc.pid, sig)
        assert wait_exit(s.proc) == code, "\n".join(s.lines)
    finally:
        s.stop()
    rest = []
    while (line := s.more.get(timeout=30)) is not None:
        rest.append(line)
    assert "Traceback" not in "\n".join(rest), rest
