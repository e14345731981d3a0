"""The relayed ZeroMQ bus (issue 13): subscribers pass versions on to one another along a chain.

Subscribers are real processes (``test_weights_auth.Child``) over tcp 127.0.0.1 with the run
secret; the publisher lives in the test process. Every wait is bounded; none decides a pass by
timing: a relay that is killed or stopped is only noticed after ``relay_bus.DEAD_S`` of silence,
and the waits here are several times that.
"""

from __future__ import annotations

import random
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

    forwards = True

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
        self.data.send_multipart([b"attach", msgpack.packb({"id": "flipper", "have": -1})])
        downstream = self.downstream
        last_hello, have = 0.0, -1
        while not self._stop.is_set():
            if time.monotonic() - last_hello > HEARTBEAT_S:
                hello = {"id": "flipper", "have": have, "relay": self.address}
                self.control.send_multipart([b"hello", msgpack.packb(hello)])
                last_hello = time.monotonic()
            while self.control.poll(0):
                self.control.recv_multipart()  # routes: this relay always takes from the publisher
            while self.router.poll(0):
                ident, kind, _ = self.router.recv_multipart()
                if kind == b"attach" and ident not in downstream:  # attach repeats every heartbeat
                    downstream.append(ident)
            if not self.data.poll(20):
                continue
            msg = self.data.recv_multipart()
            if not self.forwards:
                continue
            if msg[0] == b"manifest":  # what it passes on counts as had (it keeps no version itself)
                have = max(have, int(msgpack.unpackb(msg[2])["version"]))
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


class StuckRelay(FlippingRelay):
    """A relay that says hello but passes nothing on: alive, and as slow as a relay can be."""

    forwards = False


def test_a_live_relay_that_passes_nothing_on_is_moved_out_of_the_way():
    pub = setup_publisher(ZmqWeightsConfig(bucket_mb=1, relay=True), "tcp://127.0.0.1:*")
    stuck = StuckRelay(pub.address, flip_version=-1)
    kid = None
    try:
        deadline = time.monotonic() + 10
        while pub.stats()["subscribers"] < 1:  # the stuck relay heads the chain: the child joins after it
            assert time.monotonic() < deadline, "the fake relay never joined"
            time.sleep(0.05)
        kid = Child(pub.address, "behind", None)
        while not stuck.downstream:
            assert time.monotonic() < deadline + WAIT_S, "the child never attached to the stuck relay"
            time.sleep(0.05)
        pub.publish(1, state(1))  # only the publisher routing around the stuck relay can deliver it
        assert kid.wait_version(1, WAIT_S) == state_dict_checksum(state(1))
        assert pub.stats()["demoted"] >= 1 and pub.stats()["dropped"] == 0  # slow, not silent
        assert kid.upstream == ""  # the stuck relay is last now; the child takes from the publisher
    finally:
        if kid is not None:
            kid.close()
        stuck.close()
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


@pytest.mark.parametrize("gap_s", [0.0, 0.1])
def test_rapid_versions_reach_every_relay_in_a_chain(tmp_path, gap_s):
    """A learner publishing version after version faster than a hop forwards them (one bucket per
    version): every subscriber of the chain still ends on the last one, however many it skipped."""
    pub = setup_publisher(ZmqWeightsConfig(relay=True), f"ipc://{tmp_path}/w.sock")
    kids = [Child(pub.address, f"g{i}", None, wait=False) for i in range(3)]
    try:
        for k in kids:
            k.wait_ready()
        deadline = time.monotonic() + WAIT_S
        while pub.stats()["subscribers"] < len(kids):
            assert time.monotonic() < deadline, "the subscribers never joined"
            time.sleep(0.05)
        publish_and_check(pub, 1, kids)  # the chain is formed
        last = 60
        for v in range(2, last + 1):
            pub.publish(v, state(v))
            time.sleep(gap_s)
        want = state_dict_checksum(state(last))
        for k in kids:
            assert k.wait_version(last, 60) == want, f"{k.name}: last version differs"
        # the version after the burst still travels a chain: one subscriber fed by the publisher, the rest
        # by relays (checked on it, not on the burst's last version, which a relay that lagged and was moved
        # to the chain's end may have taken from the publisher: seen once in a full run)
        # (a relay demoted during the burst is re-routed at a heartbeat: a version sent before that lands can
        # reach the new head through its old upstream, seen once in CI, so a few more versions are allowed)
        for extra in range(1, 6):
            publish_and_check(pub, last + extra, kids)
            if sorted(k.upstream != "" for k in kids) == [False, True, True]:
                break
            time.sleep(HEARTBEAT_S)
        assert sorted(k.upstream != "" for k in kids) == [False, True, True]
        assert all(k.rejected == 0 for k in kids)
    finally:
        for k in kids:
            k.close()
        pub.close()


def test_a_forgotten_downstream_is_served_again(tmp_path):
    """An upstream that lost track of a downstream's data connection (its cursor gone, as after a
    send that found the routing id unreachable) serves it again at its next heartbeat's attach:
    without that, both hops stall silently, the tail first, the head at the next version."""
    cfg = ZmqWeightsConfig(relay=True)
    pub = setup_publisher(cfg, f"ipc://{tmp_path}/w.sock")
    subs = [setup_subscriber(cfg, pub.address, f"g{i}") for i in range(2)]
    stop = threading.Event()
    got: dict[str, str] = {}

    def generator(sub) -> None:  # polls between "engine steps" and applies (copies) each version
        rng = random.Random(sub.subscriber_id)
        while not stop.is_set():
            update = sub.poll(timeout_ms=rng.randint(0, 20))
            if update is not None:
                applied = {k: t.clone() for k, t in update.tensors.items()}
                got[sub.subscriber_id] = state_dict_checksum(applied)
            time.sleep(rng.random() * 0.05)

    threads = [threading.Thread(target=generator, args=(s,), daemon=True) for s in subs]
    for t in threads:
        t.start()

    def wait_all(version: int) -> None:
        deadline = time.monotonic() + 60
        while any(s.latest_version < version for s in subs):
            assert time.monotonic() < deadline, f"stuck at {[s.latest_version for s in subs]}, not {version}"
            time.sleep(0.05)

    try:
        pub.publish(1, state(1))
        wait_all(1)
        head = next(s for s in subs if s.upstream == "")
        assert len(head._fanout.cursors) == 1 and len(pub._fanout.cursors) == 1
        head._fanout.cursors = {}  # the relay forgets the tail's connection,
        pub._fanout.cursors = {}  # and the publisher the head's (rebinding: the threads see old or new)
        last = 40
        for v in range(2, last + 1):
            pub.publish(v, state(v))
            time.sleep(0.05)
        wait_all(last)
        time.sleep(0.2)  # the generator threads apply the last version
        assert all(got[s.subscriber_id] == state_dict_checksum(state(last)) for s in subs)
        assert all(s.rejected == 0 for s in subs)
        assert pub.stats()["demoted"] == 0 and pub.stats()["dropped"] == 0  # served again, not routed around
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
        for s in subs:
            s.close()
        pub.close()


@pytest.mark.parametrize("relay", [True, False])
def test_a_closed_bus_frees_its_versions_at_once(tmp_path, relay):
    """A publisher and a subscriber are in no reference cycle: the versions they hold go when they are
    dropped, not at a full collection that may not come (the weight bench held two 0.5 GB versions for
    every relayed case it ran, and the kernel killed it at 8.8 GB)."""
    import gc
    import weakref

    cfg = ZmqWeightsConfig(bucket_mb=1, relay=relay)
    pub = setup_publisher(cfg, f"ipc://{tmp_path}/w.sock")
    sub = setup_subscriber(cfg, pub.address, "g0")
    gc.disable()
    try:
        pub.publish(1, state(1))
        deadline = time.monotonic() + 60
        while (update := sub.poll(timeout_ms=100)) is None:
            assert time.monotonic() < deadline, "version 1 never arrived"
        assert update.checksum == state_dict_checksum(state(1))
        del update
        sub.close()
        pub.close()
        refs = [weakref.ref(pub), weakref.ref(sub)]
        del pub, sub
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()
