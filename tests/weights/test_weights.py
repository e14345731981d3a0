"""Weight bus over real sockets (tcp loopback, ipc) and the in-memory stub, same assertions."""

from __future__ import annotations

import shutil
import tempfile
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from weights_common import InjectingBus, assert_bit_equal

from asyncrl.config import MemoryWeightsConfig, ZmqWeightsConfig
from asyncrl.weights import (
    MemoryWeightBus,
    WeightsRejected,
    ZmqWeightPublisher,
    ZmqWeightSubscriber,
    decode,
    encode,
    setup_publisher,
    setup_subscriber,
    state_dict_checksum,
)

TRANSPORTS = ["tcp", "ipc", "memory"]


class Bus:
    """Publisher + subscriber factory for one transport, closing everything it made."""

    def __init__(self, transport: str, bucket_bytes: int = 1 << 20, rehello_s: float = 5.0) -> None:
        self.transport, self.rehello_s = transport, rehello_s
        self.tmp = tempfile.mkdtemp(prefix="wb", dir="/tmp")  # short: ipc paths are limited to ~100 chars
        self.closing: list = []
        if transport == "memory":
            self.pub = MemoryWeightBus(bucket_bytes=bucket_bytes).publisher()
        else:
            self.pub = ZmqWeightPublisher(self.bind_address(), bucket_bytes=bucket_bytes)
        self.closing.append(self.pub)

    def bind_address(self) -> str:
        return "tcp://127.0.0.1:*" if self.transport == "tcp" else f"ipc://{self.tmp}/w.sock"

    def sub(self, name: str = "g0", have: int = -1):
        if self.transport == "memory":
            s = self.pub.bus.subscriber(name, have)
        else:
            s = ZmqWeightSubscriber(self.pub.address, name, have, rehello_s=self.rehello_s)
        self.closing.append(s)
        return s

    def close(self) -> None:
        for x in reversed(self.closing):
            x.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(params=TRANSPORTS)
def bus(request):
    b = Bus(request.param)
    yield b
    b.close()


def wait_version(sub, version: int, timeout_s: float = 5.0):
    """Poll until ``sub`` returns ``version``; returns every update seen on the way."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while sub.latest_version < version:
        assert time.monotonic() < deadline, f"timed out at version {sub.latest_version}, want {version}"
        update = sub.poll(timeout_ms=100)
        if update is not None:
            seen.append(update)
    return seen


def make_state(seed: int, shapes: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Random bit patterns (NaN payloads, infinities, subnormals included) for every dtype."""
    g = np.random.default_rng(seed)
    out = {}
    for name, (dtype, shape) in shapes.items():
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        if t.numel():
            flat = t.reshape(-1).view(torch.uint8).numpy()
            flat[:] = g.integers(0, 256, flat.size, np.uint8)
        out[name] = t
    return out


def small_state(version: int, n: int = 4, size: int = 1000) -> dict[str, torch.Tensor]:
    return {f"layer.{i}.w": torch.full((size,), float(version)) + i for i in range(n)}


shapes_st = st.dictionaries(
    st.text("abcxyz._0123", min_size=1, max_size=12),
    st.tuples(
        st.sampled_from(["float32", "bfloat16", "int64", "float16", "bool"]),
        st.lists(st.integers(0, 40), max_size=3).map(tuple),
    ),
    max_size=6,
)


# --- wire format and checksum (pure) ---------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(shapes=shapes_st, seed=st.integers(0, 2**32 - 1), bucket=st.sampled_from([1, 64, 200, 4096, 1 << 20]))
def test_codec_round_trip_bit_exact(shapes, seed, bucket):
    state = make_state(seed, shapes)
    frames = encode(3, state, bucket)
    manifest = msgpack.unpackb(frames[1])
    assert [e["name"] for e in manifest["tensors"]] == sorted(state)
    for i, meta in enumerate(manifest["buckets"]):
        in_bucket = [e for e in manifest["tensors"] if e["bucket"] == i and e["nbytes"]]
        assert meta["nbytes"] <= bucket or len(in_bucket) == 1  # only a lone big tensor overflows
        assert all(e["offset"] % 64 == 0 for e in in_bucket)
    update = decode(frames)
    assert update.version == 3
    assert_bit_equal(update.tensors, state)
    assert update.checksum == manifest["checksum"] == state_dict_checksum(state)
    assert state_dict_checksum(update.tensors) == update.checksum


def test_checksum_is_canonical_and_sensitive():
    a = {"x": torch.arange(6, dtype=torch.float32), "y": torch.ones(2, 2, dtype=torch.bfloat16)}
    base = state_dict_checksum(a)
    assert state_dict_checksum(dict(reversed(list(a.items())))) == base  # insertion order is irrelevant
    assert state_dict_checksum({"x": a["x"][::2].clone(), "y": a["y"]}) != base
    assert state_dict_checksum({"x": a["x"].view(2, 3), "y": a["y"]}) != base  # same bytes, other shape
    assert state_dict_checksum({"x": a["x"].view(torch.int32), "y": a["y"]}) != base  # same bytes, dtype
    assert state_dict_checksum({"z": a["x"], "y": a["y"]}) != base  # renamed
    flipped = a["x"].clone()
    flipped.view(torch.uint8)[5] ^= 1
    assert state_dict_checksum({"x": flipped, "y": a["y"]}) != base
    assert state_dict_checksum({"x": a["x"][::2], "y": a["y"]}) == state_dict_checksum(
        {"x": a["x"][::2].contiguous(), "y": a["y"]}
    )  # strided views hash their values


def _corruptions(frames: list) -> dict[str, list]:
    """Hand-made bad versions of ``frames`` (a two-bucket message), each with its reason."""
    manifest = msgpack.unpackb(frames[1])
    flipped = bytearray(frames[2])
    inside = next(e for e in manifest["tensors"] if e["bucket"] == 0 and e["nbytes"])
    flipped[inside["offset"] + inside["nbytes"] // 2] ^= 0x10  # a data byte (padding is not hashed)

    def first_tensor(**change) -> bytes:
        return msgpack.packb({**manifest, "tensors": [{**manifest["tensors"][0], **change}, *manifest["tensors"][1:]]})

    return {
        "flipped byte": [frames[0], frames[1], bytes(flipped), *frames[3:]],
        "truncated bucket": [frames[0], frames[1], bytes(frames[2])[:-1], *frames[3:]],
        "missing bucket": frames[:-1],
        "bad header": [b"asyncrl.weights/0", *frames[1:]],
        "manifest not msgpack": [frames[0], b"\xc1\xc1", *frames[2:]],
        "renamed tensor": [frames[0], first_tensor(name="evil"), *frames[2:]],
        "offset out of range": [frames[0], first_tensor(offset=10**9), *frames[2:]],
        "offset not a multiple of ALIGN": [frames[0], first_tensor(offset=2), *frames[2:]],
        "unknown dtype": [frames[0], first_tensor(dtype="complex32"), *frames[2:]],
        "nbytes disagrees with shape": [frames[0], first_tensor(shape=[7]), *frames[2:]],
    }


def test_decode_rejects_every_corruption():
    frames = [bytes(f) for f in encode(1, small_state(1, n=4, size=300), 2500)]
    assert len(frames) == 4
    for reason, bad in _corruptions(frames).items():
        with pytest.raises(WeightsRejected):
            decode(bad)
            pytest.fail(reason)


# --- transports --------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", TRANSPORTS)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=shapes_st, seed=st.integers(0, 2**32 - 1), bucket=st.sampled_from([64, 4096, 1 << 20]))
def test_round_trip_over_transport(transport, shapes, seed, bucket):
    state = make_state(seed, shapes)
    state["big"] = make_state(seed, {"big": ("bfloat16", (300, 7))})["big"]  # 4200 B: bigger than a bucket
    b = Bus(transport, bucket_bytes=bucket)
    try:
        sub = b.sub()
        b.pub.publish(1, state)
        (update,) = wait_version(sub, 1)
        assert_bit_equal(update.tensors, state)
        assert update.checksum == state_dict_checksum(state) == state_dict_checksum(update.tensors)
        assert update.nbytes == sum(t.numel() * t.element_size() for t in state.values())
        assert sub.rejected == 0
    finally:
        b.close()


def test_publisher_owns_a_snapshot(bus):
    """publish copies: changing the tensors afterwards does not change what subscribers get."""
    sub = bus.sub()
    state = {"w": torch.zeros(1000)}
    bus.pub.publish(1, state)
    want = state_dict_checksum(state)
    state["w"].fill_(7.0)
    (update,) = wait_version(sub, 1)
    assert update.checksum == want and torch.equal(update.tensors["w"], torch.zeros(1000))


def test_late_subscriber_gets_newest_at_once(bus):
    early = bus.sub("early")
    for v in range(1, 4):
        bus.pub.publish(v, small_state(v))
    wait_version(early, 3)  # the publisher has sent v3, so a late joiner can only be served by hello
    late = bus.sub("late")
    t0 = time.monotonic()
    update = late.poll(timeout_ms=3000)
    assert update is not None and update.version == 3, "late joiner must not wait for the next version"
    assert time.monotonic() - t0 < 1.0
    assert update.checksum == state_dict_checksum(small_state(3))
    # A subscriber that already has the newest version is not sent it again.
    current = bus.sub("current", have=3)
    assert current.poll(timeout_ms=200) is None and current.latest_version == 3


def test_rapid_versions_end_on_newest(bus):
    sub = bus.sub()
    n = 30
    for v in range(1, n + 1):
        bus.pub.publish(v, small_state(v, size=5_000))
    seen = wait_version(sub, n)
    versions = [u.version for u in seen]
    assert versions == sorted(set(versions)) and versions[-1] == n  # strictly increasing, ends on newest
    if bus.transport == "memory":
        assert versions == [n]  # everything was queued before the first poll: only the newest is applied
    assert seen[-1].checksum == state_dict_checksum(small_state(n, size=5_000))
    assert sub.poll(timeout_ms=100) is None  # nothing older comes back afterwards


def test_publish_rejects_non_increasing_version(bus):
    bus.pub.publish(5, small_state(5))
    with pytest.raises(ValueError):
        bus.pub.publish(5, small_state(5))
    with pytest.raises(ValueError):
        bus.pub.publish(4, small_state(4))


def test_stalled_and_closed_subscribers_do_not_block_publish(bus):
    stalled = bus.sub("stalled")  # never polls
    closed = bus.sub("closed")
    closed.close()
    if bus.transport != "memory":
        # A peer that said hello and then never reads, with the smallest receive queue.
        ghost = zmq.Context.instance().socket(zmq.DEALER)
        ghost.setsockopt(zmq.RCVHWM, 1)
        ghost.setsockopt(zmq.LINGER, 0)
        ghost.connect(bus.pub.address)
        ghost.send_multipart([b"hello", msgpack.packb({"id": "ghost", "have": -1})])
        bus.closing.append(ghost)
    healthy = bus.sub("healthy")
    state = {f"w{i}": torch.randn(256, 1024) for i in range(4)}  # 4 MiB
    t0 = time.monotonic()
    for v in range(1, 21):
        state["w0"][0, 0] = v
        bus.pub.publish(v, state)
    elapsed = time.monotonic() - t0
    assert elapsed < 5.0, f"20 publishes of 4 MiB took {elapsed:.1f}s"
    seen = wait_version(healthy, 20)
    assert seen[-1].checksum == state_dict_checksum(state)
    assert stalled.latest_version == -1  # still alive, just never asked
    # When it finally reads it catches up to the newest, skipping most of what it missed (over
    # ZeroMQ it may first see the few versions already queued at its end).
    caught_up = wait_version(stalled, 20)
    assert caught_up[-1].checksum == state_dict_checksum(state) and len(caught_up) <= 5
    # Every version either got verified: bucket arrays the publisher reused were never ones still
    # queued to a peer (over ZeroMQ they are reused only once its trackers say all sends are done).
    assert healthy.rejected == stalled.rejected == 0
    if bus.transport != "memory":
        assert bus.pub.stats()["buckets_reused"] > 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_corrupted_versions_are_rejected_and_old_version_kept(transport):
    """A fake publisher sends good v1, then bad v2..., then good v10: only v1 and v10 are applied."""
    good1 = [bytes(f) for f in encode(1, small_state(1, n=4, size=300), 2500)]
    good10 = [bytes(f) for f in encode(10, small_state(10, n=4, size=300), 2500)]
    bad = list(_corruptions([bytes(f) for f in encode(2, small_state(2, n=4, size=300), 2500)]).values())
    tmp = tempfile.mkdtemp(prefix="wb", dir="/tmp")
    if transport == "memory":
        fake = InjectingBus()
        sub = fake.subscriber("g0")
        send = fake.inject
    else:
        router = zmq.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind("tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{tmp}/fake.sock")
        sub = ZmqWeightSubscriber(router.getsockopt_string(zmq.LAST_ENDPOINT), "g0")
        assert router.poll(2000), "subscriber sent no hello"
        ident, kind, body = router.recv_multipart()
        assert kind == b"hello" and msgpack.unpackb(body) == {"id": "g0", "have": -1, "base": -1, "full": False}

        def send(frames):
            router.send_multipart([ident, *frames])

    try:
        send(good1)
        assert wait_version(sub, 1)[-1].checksum == state_dict_checksum(small_state(1, n=4, size=300))
        for i, frames in enumerate(bad, start=1):
            send(frames)
            deadline = time.monotonic() + 2
            while sub.rejected < i:
                assert sub.poll(timeout_ms=20) is None and time.monotonic() < deadline
            assert sub.rejected == i and sub.latest_version == 1
        send(good10)
        assert wait_version(sub, 10)[-1].version == 10
        # Newest-first: a bad newest version does not hide a good older one received with it.
        send(good1[:1] + [msgpack.packb({**msgpack.unpackb(good10[1]), "version": 12})] + good10[2:-1])
        good11 = [bytes(f) for f in encode(11, small_state(11, n=4, size=300), 2500)]
        send(good11)
        time.sleep(0.1)  # both messages queued: poll sees them together
        update = sub.poll(timeout_ms=500)
        assert update is not None and update.version == 11 and sub.rejected == len(bad) + 1
    finally:
        sub.close()
        if transport != "memory":
            router.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_subscriber_before_publisher_and_publisher_restart():
    """ipc: a subscriber may connect first; after a publisher restart at the same address, the
    subscriber's repeated hello makes the new publisher serve it."""
    b = Bus("ipc", rehello_s=0.2)
    address = b.bind_address()
    b.pub.close()
    try:
        sub = ZmqWeightSubscriber(address, "early", rehello_s=0.2)
        b.closing.append(sub)
        pub = ZmqWeightPublisher(address, bucket_bytes=1 << 20)
        pub.publish(1, small_state(1))
        wait_version(sub, 1)
        pub.close()
        pub2 = ZmqWeightPublisher(address, bucket_bytes=1 << 20)
        b.closing.append(pub2)
        pub2.publish(2, small_state(2))
        assert wait_version(sub, 2)[-1].checksum == state_dict_checksum(small_state(2))
    finally:
        b.close()


def test_bye_forgets_subscriber():
    b = Bus("tcp")
    try:
        subs = [b.sub(f"g{i}") for i in range(3)]
        b.pub.publish(1, small_state(1))
        for s in subs:
            wait_version(s, 1)
        assert b.pub.stats()["subscribers"] == 3
        subs[0].close()
        deadline = time.monotonic() + 2
        while b.pub.stats()["subscribers"] != 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        b.close()


@pytest.mark.parametrize(
    ("cfg", "address"),
    [(ZmqWeightsConfig(bucket_mb=1), None), (MemoryWeightsConfig(bucket_mb=1), "memory://factory-test")],
)
def test_factories(cfg, address):
    pub = setup_publisher(cfg, address)
    sub = setup_subscriber(cfg, pub.address, "g0", have=0)
    try:
        assert pub.address.startswith("tcp://127.0.0.1:" if cfg.type == "zmq" else "memory://")
        pub.publish(0, small_state(0))  # the subscriber already has version 0
        pub.publish(1, small_state(1))
        seen = wait_version(sub, 1)
        assert [u.version for u in seen] == [1]
    finally:
        sub.close()
        pub.close()


def test_the_transport_is_the_sections_type_alone():
    """An address never picks a transport: one in another transport's scheme is an error naming both."""
    with pytest.raises(ValueError, match=r"weights.type=zmq speaks tcp:// or ipc://, not 'memory://x'"):
        setup_publisher(ZmqWeightsConfig(), "memory://x")
    with pytest.raises(ValueError, match=r"weights.type=memory speaks memory://"):
        setup_subscriber(MemoryWeightsConfig(), "tcp://127.0.0.1:5555", "g0")
    with pytest.raises(ValueError, match=r"weights.type=zmq speaks tcp:// or ipc://, not 'shm://"):
        setup_subscriber(ZmqWeightsConfig(), "shm:///dev/shm/x", "g0")
