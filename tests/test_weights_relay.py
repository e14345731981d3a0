"""The relayed ZeroMQ bus (issue 13): subscribers pass versions on to one another along a chain.

Subscribers are real processes (``test_weights_auth.Child``) over tcp 127.0.0.1 with the run
secret; the publisher lives in the test process. Every wait is bounded; none decides a pass by
timing: a relay that is killed or stopped is only noticed after ``relay_bus.DEAD_S`` of silence,
and the waits here are several times that.
"""

from __future__ import annotations

import signal
import threading
import time

import msgpack
import pytest
import zmq
from test_weights_auth import Child, state

from asyncrl.config import ZmqWeightsConfig
from asyncrl.secret import new_secret
from asyncrl.weights import setup_publisher, setup_subscriber, state_dict_checksum
from asyncrl.weights.relay_bus import DEAD_S, HEARTBEAT_S, Member, chain_routes

WAIT_S = 6 * DEAD_S + 30  # bypassing a relay takes about DEAD_S + HEARTBEAT_S, plus the transfer


@pytest.fixture
def fleet():
    """A relaying publisher with the run secret, and a factory of subscriber processes."""
    secret = new_secret()
    pub = setup_publisher(ZmqWeightsConfig(bucket_mb=1, relay=True), "tcp://127.0.0.1:*", secret=secret)
    made: list[Child] = []

    def spawn(n: int, prefix: str = "g") -> list[Child]:
        kids = [Child(pub.address, f"{prefix}{len(made) + i}", secret, wait=False) for i in range(n)]
        made.extend(kids)
        for k in kids:
            k.wait_ready()
        return kids

    yield pub, spawn
    for c in made:
        c.close()
    pub.close()


def publish_and_check(pub, version: int, kids: list[Child]) -> None:
    pub.publish(version, state(version))
    want = state_dict_checksum(state(version))
    for k in kids:
        assert k.wait_version(version, WAIT_S) == want, f"{k.name}: version {version} differs"


def downstream_of(kid: Child, kids: list[Child]) -> list[Child]:
    return [k for k in kids if k.upstream == kid.relay]


def test_chain_routes_feed_everyone_once():
    members = [Member(f"m{i}", f"tcp://h:{i}" if i != 2 else "", i, i) for i in range(5)]
    assert chain_routes(members) == ["", "tcp://h:0", "tcp://h:1", "tcp://h:1", "tcp://h:3"]
    assert chain_routes([]) == []


def test_chain_of_four_is_bit_exact(fleet):
    pub, spawn = fleet
    kids = spawn(4)
    for v in (1, 2, 3):
        publish_and_check(pub, v, kids)
    # A chain: one subscriber takes from the publisher, every other one from another's relay.
    assert sorted(k.upstream != "" for k in kids) == [False, True, True, True]
    assert {k.upstream for k in kids} - {""} <= {k.relay for k in kids}
    assert all(k.rejected == 0 for k in kids)
    assert pub.stats()["sends"] <= 3 + 1  # about once per version, not once per subscriber


def test_killed_middle_relay_is_bypassed(fleet):
    pub, spawn = fleet
    kids = spawn(4)
    publish_and_check(pub, 1, kids)
    middle = next(k for k in kids if k.upstream and downstream_of(k, kids))
    middle.signal(signal.SIGKILL)
    rest = [k for k in kids if k is not middle]
    for v in (2, 3):
        publish_and_check(pub, v, rest)


def test_stopped_relay_is_bypassed_and_rejoins(fleet):
    pub, spawn = fleet
    kids = spawn(3)
    publish_and_check(pub, 1, kids)
    head = next(k for k in kids if k.upstream == "")
    head.signal(signal.SIGSTOP)
    rest = [k for k in kids if k is not head]
    publish_and_check(pub, 2, rest)
    head.signal(signal.SIGCONT)
    head.wait_version(2, WAIT_S)  # the newest, without a new publish
    publish_and_check(pub, 3, kids)


def test_late_joiner_gets_newest_at_once(fleet):
    pub, spawn = fleet
    kids = spawn(2)
    publish_and_check(pub, 1, kids)
    publish_and_check(pub, 2, kids)
    (late,) = spawn(1, "late")
    assert late.wait_version(2, WAIT_S) == state_dict_checksum(state(2))
    assert late.upstream in {k.relay for k in kids}  # served by a relay, not by the publisher


class FlippingRelay:
    """A relay that passes on what the publisher sends but flips one byte of one version's first
    bucket: what a faulty host or link between two generators would do."""

    def __init__(self, publisher: str, flip_version: int) -> None:
        ctx = zmq.Context.instance()
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.address = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.control, self.data = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for sock in (self.control, self.data):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(publisher)
        self.flip_version = flip_version
        self.flipped = 0
        self.downstream: list[bytes] = []  # attached subscribers (it keeps no version for late ones)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        hello = msgpack.packb({"id": "flipper", "have": -1, "relay": self.address})
        self.data.send_multipart([b"attach", msgpack.packb({"id": "flipper", "have": -1})])
        downstream = self.downstream
        last_hello = 0.0
        while not self._stop.is_set():
            if time.monotonic() - last_hello > HEARTBEAT_S:
                self.control.send_multipart([b"hello", hello])
                last_hello = time.monotonic()
            while self.control.poll(0):
                self.control.recv_multipart()  # routes: this relay always takes from the publisher
            while self.router.poll(0):
                ident, kind, _ = self.router.recv_multipart()
                if kind == b"attach":
                    downstream.append(ident)
            if not self.data.poll(20):
                continue
            msg = self.data.recv_multipart()
            if msg[0] == b"bucket" and msgpack.unpackb(msg[1]) == [self.flip_version, 0]:
                data = bytearray(msg[2])
                data[0] ^= 0x01  # the first tensor starts at offset 0: a data byte, covered by the checksum
                msg[2] = bytes(data)
                self.flipped += 1
            for ident in downstream:
                self.router.send_multipart([ident, *msg])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for sock in (self.router, self.control, self.data):
            sock.close()


def test_corrupted_bucket_at_a_relay_is_rejected_downstream():
    pub = setup_publisher(ZmqWeightsConfig(bucket_mb=1, relay=True), "tcp://127.0.0.1:*")
    flipper = FlippingRelay(pub.address, flip_version=2)
    kid = None
    try:
        deadline = time.monotonic() + 10
        while pub.stats()["subscribers"] < 1:  # the flipper heads the chain: the child joins after it
            assert time.monotonic() < deadline, "the fake relay never joined"
            time.sleep(0.05)
        kid = Child(pub.address, "victim", None)
        while not flipper.downstream:
            assert time.monotonic() < deadline + WAIT_S, "the child never attached to the fake relay"
            time.sleep(0.05)
        pub.publish(1, state(1))
        assert kid.wait_version(1, WAIT_S) == state_dict_checksum(state(1))
        assert kid.upstream == flipper.address
        pub.publish(2, state(2))
        deadline = time.monotonic() + WAIT_S
        while flipper.flipped < 1:
            assert time.monotonic() < deadline, "version 2 never reached the fake relay"
            time.sleep(0.05)
        pub.publish(3, state(3))
        assert kid.wait_version(3, WAIT_S) == state_dict_checksum(state(3))
        assert 2 not in kid.versions and kid.rejected == 1  # v2 failed its bucket check; v1 was kept until v3
    finally:
        if kid is not None:
            kid.close()
        flipper.close()
        pub.close()


def test_relays_of_an_ipc_publisher_bind_next_to_it(tmp_path):
    """ipc: every relay endpoint is a socket in the publisher's directory, gone after close."""
    cfg = ZmqWeightsConfig(bucket_mb=1, relay=True)
    pub = setup_publisher(cfg, f"ipc://{tmp_path}/w.sock")
    subs = [setup_subscriber(cfg, pub.address, f"g{i}") for i in range(3)]
    try:
        for v in (1, 2):
            pub.publish(v, state(v))
            for s in subs:
                deadline = time.monotonic() + WAIT_S
                while s.latest_version < v:
                    assert time.monotonic() < deadline, f"{s.subscriber_id} stuck at {s.latest_version}"
                    update = s.poll(timeout_ms=100)
                    if update is not None:
                        assert state_dict_checksum(update.tensors) == state_dict_checksum(state(update.version))
        assert sorted(s.upstream != "" for s in subs) == [False, True, True]
        assert all(s.relay_address.startswith(f"ipc://{tmp_path}/") for s in subs)
    finally:
        for s in subs:
            s.close()
        pub.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.sock"]
