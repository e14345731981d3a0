"""Only the run's own user can read its weights (issue 11, defect 7): a learner's zmq publisher binds an
ipc socket in the 0700 run directory, and the kernel refuses another user's connect. Over the old
default (loopback tcp) a stdlib client running as ``nobody`` received the full state dict."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from asyncrl.config import NcclWeightsConfig, ShmWeightsConfig, ZmqWeightsConfig
from asyncrl.weights import private_address, setup_publisher, setup_subscriber

NOBODY = 65534
CONNECTED, REFUSED = 0, 13


def client(kind: str, where: str, nobody: bool) -> str:
    """Connect to the endpoint from a forked child (as ``nobody`` if asked) with nothing but a socket:
    what any local user's program could do."""
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, just an exit status
        code = 1
        try:
            if nobody:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            s = socket.socket(socket.AF_UNIX if kind == "ipc" else socket.AF_INET)
            s.connect(where if kind == "ipc" else ("127.0.0.1", int(where)))
            code = CONNECTED
        except PermissionError:
            code = REFUSED
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return {CONNECTED: "connected", REFUSED: "refused"}.get(os.waitstatus_to_exitcode(status), "error")


def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    d.chmod(0o700)
    os.chmod(tmp_path, 0o755)  # the parent is searchable: only the run directory's own mode protects it
    return d


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_another_user_cannot_connect_to_the_weight_bus(tmp_path):
    address = private_address(ZmqWeightsConfig(), run_dir(tmp_path))
    assert address.startswith("ipc://") and address.endswith("/run/weights.sock")
    pub = setup_publisher(ZmqWeightsConfig(), address)
    try:
        state = {"w": torch.arange(6, dtype=torch.float32)}
        pub.publish(1, state)
        path = pub.address.removeprefix("ipc://")
        assert client("ipc", path, nobody=True) == "refused"
        assert client("ipc", path, nobody=False) == "connected"
        sub = setup_subscriber(ZmqWeightsConfig(), pub.address, "gen-0")  # the run's own processes still can
        try:
            update = sub.poll(timeout_ms=30_000)
            assert update is not None and update.version == 1 and torch.equal(update.tensors["w"], state["w"])
        finally:
            sub.close()
    finally:
        pub.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_the_old_default_loopback_tcp_admits_any_local_user():
    """Why the learner no longer uses it: the same client as ``nobody`` gets in over tcp."""
    pub = setup_publisher(ZmqWeightsConfig())
    try:
        port = pub.address.rsplit(":", 1)[1]
        assert client("tcp", port, nobody=True) == "connected"
    finally:
        pub.close()


def test_a_run_directory_too_long_for_a_socket_gets_a_private_short_one(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    first = private_address(ZmqWeightsConfig(), deep)
    assert first == private_address(ZmqWeightsConfig(), deep)  # restarts reuse it
    short = os.path.dirname(first.removeprefix("ipc://"))
    assert len(first) < 120 and oct(os.stat(short).st_mode & 0o777) == "0o700"
    os.rmdir(short)


def test_other_transports_keep_their_own_endpoints(tmp_path):
    assert private_address(ShmWeightsConfig(), tmp_path) is None  # shm makes its own 0700 directory
    assert private_address(NcclWeightsConfig.model_construct(), tmp_path) is None
