"""Only holders of the run secret can read the weights over tcp, or feed a subscriber (issue 13).

Every subscriber here is a real process (this file run as a script, see ``child_main``) on tcp
127.0.0.1; the secret reaches it in ``ASYNCRL_SECRET``, never in its arguments. The negative cases
wait a bounded time and assert that nothing arrived: a broken handshake delivers at once, so a
pass never depends on a race.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from asyncrl.config import ZmqWeightsConfig
from asyncrl.secret import new_secret
from asyncrl.weights import setup_publisher, setup_subscriber, state_dict_checksum
from asyncrl.weights.curve import curve_keys

ROOT = Path(__file__).resolve().parents[2]
QUIET_S = 3.0  # how long a subscriber that must get nothing is watched


def state(version: int, n: int = 6, size: int = 100_000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {f"layer.{i}.w": torch.randn(size, generator=g) for i in range(n)}


# --- a subscriber process ---------------------------------------------------------------------------
def child_main(spec: dict) -> None:
    """Subscribe as ``spec`` says and print one JSON line per version that ``poll`` returns; exit
    when stdin closes. Logs go to stderr at DEBUG (a test reads them for secrets)."""
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s %(message)s")
    cfg = ZmqWeightsConfig(bucket_mb=1, relay=spec.get("relay", True))
    secret = os.environ.get("ASYNCRL_SECRET") or None
    sub = setup_subscriber(cfg, spec["address"], spec["id"], spec.get("have", -1), secret=secret)
    eof = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), eof.set()), daemon=True).start()
    print(json.dumps({"ready": True, "relay": getattr(sub, "relay_address", "")}), flush=True)
    while not eof.is_set():
        update = sub.poll(timeout_ms=50)
        if update is not None:
            line = {"version": update.version, "checksum": state_dict_checksum(update.tensors)}
            line.update(rejected=sub.rejected, upstream=getattr(sub, "upstream", ""))
            print(json.dumps(line), flush=True)
    sub.close()


class Child:
    """A subscriber process: its reports in ``versions`` (version -> checksum), ended by ``close``."""

    def __init__(self, address: str, name: str, secret: str | None, wait: bool = True, **spec) -> None:
        env = {k: v for k, v in os.environ.items() if k != "ASYNCRL_SECRET"}
        if secret:
            env["ASYNCRL_SECRET"] = secret
        env["PYTHONPATH"] = str(ROOT)
        arg = json.dumps({"address": address, "id": name, **spec})
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, __file__, arg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.versions: dict[int, str] = {}
        self.rejected = 0
        self.ready = False
        self.relay = ""  # its relay endpoint
        self.upstream: str | None = None  # where its last version came from ("" = the publisher)
        self._lines: queue.Queue = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self._lines.put), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self._stderr.append), daemon=True).start()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        assert self._drain(lambda: self.ready, 60.0), f"{self.name} did not start"

    @staticmethod
    def _read(stream, put) -> None:
        for line in stream:
            put(line)

    def _drain(self, done, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            try:
                line = self._lines.get(timeout=max(0.01, min(0.1, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    return False
                continue
            msg = json.loads(line)
            if msg.get("ready"):
                self.ready, self.relay = True, msg["relay"]
            else:
                self.versions[msg["version"]] = msg["checksum"]
                self.rejected, self.upstream = msg["rejected"], msg["upstream"]
        return True

    def wait_version(self, version: int, timeout_s: float = 30.0) -> str:
        assert self._drain(lambda: version in self.versions, timeout_s), (
            f"{self.name} has {sorted(self.versions)}, not {version}"
        )
        return self.versions[version]

    def watch(self, seconds: float) -> dict[int, str]:
        self._drain(lambda: False, seconds)
        return self.versions

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)  # our own child, by handle

    def logs(self) -> str:
        return "".join(self._stderr)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture
def children():
    made: list[Child] = []

    def make(*args, **kwargs) -> Child:
        made.append(Child(*args, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.close()


# --- tests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("relay", [False, True])
def test_only_the_secret_holder_receives(children, relay):
    secret = new_secret()
    pub = setup_publisher(ZmqWeightsConfig(bucket_mb=1, relay=relay), "tcp://127.0.0.1:*", secret=secret)
    try:
        good = children(pub.address, "good", secret, relay=relay)
        none = children(pub.address, "none", None, relay=relay)
        wrong = children(pub.address, "wrong", new_secret(), relay=relay)
        for v in (1, 2):
            pub.publish(v, state(v))
            assert good.wait_version(v) == state_dict_checksum(state(v))  # bit-exact: same checksum
        assert none.watch(QUIET_S) == {} and wrong.watch(0.1) == {}
        pub.publish(3, state(3))  # the publisher keeps serving the holder while the others knock
        assert good.wait_version(3) == state_dict_checksum(state(3))
    finally:
        pub.close()


@pytest.mark.parametrize("publisher_secret", ["wrong", "none"])
def test_a_publisher_without_the_secret_cannot_feed_a_subscriber(children, publisher_secret):
    secret = new_secret()
    other = new_secret() if publisher_secret == "wrong" else None
    pub = setup_publisher(ZmqWeightsConfig(bucket_mb=1), "tcp://127.0.0.1:*", secret=other)
    try:
        sub = children(pub.address, "victim", secret)
        pub.publish(1, state(1))
        pub.publish(2, state(2))
        assert sub.watch(QUIET_S) == {}
    finally:
        pub.close()


@pytest.mark.parametrize("relay", [False, True])
def test_knowing_the_server_key_is_not_enough(relay):
    """A client that has the publisher's public key (it is no secret) but not the client key pair
    derived from the secret is refused by the ZAP handler: it is never registered, gets nothing."""
    secret = new_secret()
    pub = setup_publisher(ZmqWeightsConfig(bucket_mb=1, relay=relay), "tcp://127.0.0.1:*", secret=secret)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        # once the refused handshake drops the connection a DEALER's send waits for a peer forever: bounded
        sock.setsockopt(zmq.SNDTIMEO, 1000)
        sock.curve_serverkey = curve_keys(secret, pub.address).server_public
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.connect(pub.address)
        with contextlib.suppress(zmq.Again):  # refused before these were queued: the forger sent nothing
            sock.send_multipart([b"hello", msgpack.packb({"id": "forger", "have": -1, "relay": ""})])
            sock.send_multipart([b"attach", msgpack.packb({"id": "forger", "have": -1})])
        pub.publish(1, state(1))
        assert not sock.poll(int(QUIET_S * 1000))
        assert pub.stats()["subscribers"] == 0
    finally:
        sock.close()
        pub.close()


def test_no_secret_in_logs(children, caplog):
    secret = new_secret()
    keys = curve_keys(secret, "tcp://")
    caplog.set_level(logging.DEBUG)
    pub = setup_publisher(ZmqWeightsConfig(bucket_mb=1, relay=True), "tcp://127.0.0.1:*", secret=secret)
    try:
        subs = [children(pub.address, f"g{i}", secret) for i in range(2)]
        intruder = children(pub.address, "intruder", new_secret())
        pub.publish(1, state(1))
        for s in subs:
            s.wait_version(1)
    finally:
        pub.close()
    for c in [*subs, intruder]:
        c.close()
    logs = caplog.text + "".join(c.logs() for c in [*subs, intruder])
    assert "subscriber g0 joined" in logs  # the logs were captured at all
    for value in (secret, keys.server_secret.decode(), keys.client_secret.decode()):
        assert value not in logs


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
