"""Collective weight bus over real sockets and real process groups: gloo on CPU here, the same
code and the same assertions with NCCL on CUDA (``gpu``). Subscribers run in separate processes
where it matters (late joiners, SIGKILLed and SIGSTOPped subscribers)."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pydantic
import pytest
import torch
from weights_common import assert_bit_equal, random_bits

from asyncrl.config import NcclWeightsConfig
from asyncrl.weights import (
    CollectiveWeightPublisher,
    CollectiveWeightSubscriber,
    setup_publisher,
    setup_subscriber,
    state_dict_checksum,
)
from asyncrl.weights.collective_buckets import DeviceSnapshot, bucket_checksums

ROOT = Path(__file__).resolve().parents[2]
# Short, so that a dead or stopped member costs the tests about a second or two, not 30.
TIMEOUT_S = 1.5
# NCCL refuses two ranks of one group on one GPU: the publisher takes cuda:0, each subscriber
# another GPU (the round trip has at most three ranks at a time).
GPUS = torch.cuda.device_count() if torch.cuda.is_available() and torch.distributed.is_nccl_available() else 0
HAS_NCCL = GPUS >= 3
BACKENDS = [
    "gloo",
    pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_NCCL, reason="needs 3 CUDA GPUs")]),
]

# A subscriber process. It starts importing at once (so the pool below can warm it up while other
# tests run), then reads its publisher from stdin and prints one JSON line per new version, until
# stdin closes.
CHILD = r"""
import json, select, sys
from asyncrl.weights import CollectiveWeightSubscriber, state_dict_checksum
args = json.loads(sys.stdin.readline() or "null")
if args is None:
    sys.exit(0)
sub = CollectiveWeightSubscriber(**args, rehello_s=0.5)
print(json.dumps({"started": True}), flush=True)
while not select.select([sys.stdin], [], [], 0)[0]:
    update = sub.poll(timeout_ms=50)
    if update is not None:
        cpu = {k: t.cpu() for k, t in update.tensors.items()}
        print(json.dumps({"version": update.version, "checksum": state_dict_checksum(cpu),
                          "device": str(next(iter(update.tensors.values())).device)}), flush=True)
sub.close()
"""
# Subscriber processes the tests below use; all are started with the module, before any test.
POOL_SIZE = 3 + HAS_NCCL  # one each for the process tests below (and the nccl round trip)


@pytest.fixture(scope="module", autouse=True)
def pool():
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(POOL_SIZE)
    ]
    yield procs
    for proc in procs:
        end(proc)


def read_until(proc: subprocess.Popen, version: int, timeout_s: float = 30.0) -> dict:
    """The child's report of ``version`` (earlier reports are skipped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"child {proc.pid} did not report version {version} in {timeout_s}s"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            continue
        line = proc.stdout.readline()
        assert line, f"child {proc.pid} exited with {proc.wait()}"
        report = json.loads(line)
        if report.get("version") is not None and report["version"] >= version:
            assert report["version"] == version, report
            return report


def end(proc: subprocess.Popen) -> None:
    """Stop a child this test module started, by its pid: closing stdin asks it to close its
    subscriber and exit; one that does not is killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for stream in (proc.stdin, proc.stdout):
        if stream and not stream.closed:
            stream.close()


def mixed_state(seed: int = 0) -> dict[str, torch.Tensor]:
    wide = random_bits(torch.float32, (48, 64), seed + 3)
    return {
        "embed.weight": random_bits(torch.float32, (300, 40), seed + 1),  # 48000 B: bigger than a bucket
        "layer.0.attn.weight": random_bits(torch.bfloat16, (64, 96), seed + 2),
        "layer.0.mlp.weight.T": wide.t(),  # non-contiguous
        "layer.0.mlp.rows": wide[::3, 5:40],  # strided slice
        "layer.0.norm": random_bits(torch.float16, (33,), seed + 5),  # odd byte count: padding
        "positions": torch.arange(-500, 500, dtype=torch.int64).reshape(10, 100),
        "mask": random_bits(torch.uint8, (77,), seed + 4) > 127,
        "scale": torch.tensor(0.125),  # 0-d
        "empty": torch.empty(0, 7),
    }


def small_state(version: int) -> dict[str, torch.Tensor]:
    return {f"layer.{i}.w": torch.full((500,), float(version)) + i for i in range(3)}


def wait_version(sub, version: int, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    last = None
    while sub.latest_version < version:
        assert time.monotonic() < deadline, f"timed out at version {sub.latest_version}, want {version}"
        last = sub.poll(timeout_ms=50) or last
    return last


def wait_for(cond, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Bus:
    """A publisher (in this process) and in-process subscribers, all closed at the end."""

    def __init__(
        self, backend: str = "gloo", bucket_bytes: int = 4096, publisher: type = CollectiveWeightPublisher
    ) -> None:
        self.backend = backend
        self.device = "cuda:0" if backend == "nccl" else "cpu"
        self._gpu = 0  # the last GPU handed to a subscriber
        self.pub = publisher(
            "tcp://127.0.0.1:*", backend=backend, device=self.device, bucket_bytes=bucket_bytes, timeout_s=TIMEOUT_S
        )
        self.closing: list = [self.pub]

    def sub(self, name: str, have: int = -1) -> CollectiveWeightSubscriber:
        s = CollectiveWeightSubscriber(
            self.pub.address, name, have, backend=self.backend, device=self.sub_device(), timeout_s=TIMEOUT_S
        )
        self.closing.insert(0, s)
        return s

    def sub_device(self) -> str:
        """cpu for gloo; for nccl the GPUs after cuda:0 in turn."""
        if self.backend != "nccl":
            return "cpu"
        self._gpu = self._gpu % (GPUS - 1) + 1
        return f"cuda:{self._gpu}"

    def spawn(self, pool: list[subprocess.Popen], name: str) -> subprocess.Popen:
        """A subscriber in a process of its own, taken from the module's warm pool."""
        proc = pool.pop()
        args = {"address": self.pub.address, "subscriber_id": name, "backend": self.backend}
        proc.device = self.sub_device()
        proc.stdin.write(json.dumps({**args, "device": proc.device, "timeout_s": TIMEOUT_S}) + "\n")
        proc.stdin.flush()
        self.closing.insert(0, proc)
        return proc

    def close(self) -> None:
        # The publisher first: subscribers then close at once instead of completing a re-formation.
        self.closing.remove(self.pub)
        self.closing.insert(0, self.pub)
        for x in self.closing:
            end(x) if isinstance(x, subprocess.Popen) else x.close()


@pytest.fixture
def bus():
    b = Bus()
    yield b
    b.close()


# In-process subscribers first: the pool's processes import torch meanwhile.
# --- pure --------------------------------------------------------------------------------------------
def test_bucket_checksum_catches_single_word_changes_swaps_and_shifts():
    base = random_bits(torch.uint8, (4096,), 7)
    ref = bucket_checksums([base])[0]
    assert bucket_checksums([base.clone()])[0] == ref
    flipped = base.clone()
    flipped[1001] ^= 0x80
    swapped = base.clone().view(torch.int32)
    swapped[[3, 900]] = swapped[[900, 3]]
    shifted = torch.cat([base[4:], base[:4]])  # every word moved one place
    for bad in (flipped, swapped.view(torch.uint8), shifted):
        assert bucket_checksums([bad])[0] != ref
    assert bucket_checksums([torch.zeros(0, dtype=torch.uint8)]) == [f"{0:032x}"]


def test_nccl_config_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(pydantic.ValidationError, match="needs CUDA GPUs"):
        NcclWeightsConfig()


# --- verification ------------------------------------------------------------------------------------
class TamperingPublisher(CollectiveWeightPublisher):
    """The publisher with a seam for these tests: ``tamper(snapshot)`` changes each version after its
    bucket checksums were taken, before it is sent."""

    tamper: Callable[[DeviceSnapshot], None] | None = None

    def _take(self, snap: DeviceSnapshot) -> None:
        super()._take(snap)
        if self.tamper is not None:
            self.tamper(snap)


def test_corrupted_bucket_and_shape_mismatch_are_rejected_and_old_version_kept(caplog):
    bus = Bus(publisher=TamperingPublisher)
    try:
        sub = bus.sub("g0")
        bus.pub.publish(1, small_state(1))
        wait_version(sub, 1)

        def flip_a_byte(snap: DeviceSnapshot) -> None:
            snap.buckets[-1][5] ^= 1

        def wrong_shape(snap: DeviceSnapshot) -> None:
            snap.entries[0]["shape"] = [7]

        with caplog.at_level(logging.WARNING, logger="asyncrl.weights"):
            for version, tamper, reason in ((2, flip_a_byte, "checksum mismatch"), (3, wrong_shape, "does not match")):
                bus.pub.tamper = tamper
                bus.pub.publish(version, small_state(version))
                wait_for(lambda v=version: sub.rejected == v - 1, what=f"rejection of version {version}")
                assert sub.poll(timeout_ms=100) is None and sub.latest_version == 1
                assert reason in caplog.text and "keeping version 1" in caplog.text
        bus.pub.tamper = None
        bus.pub.publish(4, small_state(4))
        assert_bit_equal(wait_version(sub, 4).tensors, small_state(4), "cpu")
        assert sub.rejected == 2
    finally:
        bus.close()


# --- membership (in process) -------------------------------------------------------------------------
def test_subscribers_come_and_go_at_any_time(bus):
    a = bus.sub("a")
    bus.pub.publish(1, small_state(1))
    wait_version(a, 1)
    b = bus.sub("b")  # joins with no new version: gets v1 at once
    wait_version(b, 1)
    for v in range(2, 8):  # members leave and join while versions are in flight
        bus.pub.publish(v, small_state(v))
        if v == 3:
            a.close()
        if v == 4:
            c = bus.sub("c", have=1)
        if v == 5:
            d = bus.sub("d")
            d.close()  # leaves before it ever received anything
    for s in (b, c):
        assert_bit_equal(wait_version(s, 7).tensors, small_state(7), "cpu")
    wait_for(lambda: bus.pub.stats()["subscribers"] == 2, what="two subscribers left")
    e = bus.sub("e")
    assert wait_version(e, 7).version == 7


def test_late_subscriber_gets_newest_at_once_without_a_new_publish(bus):
    early = bus.sub("early")
    for v in range(1, 4):
        bus.pub.publish(v, small_state(v))
    wait_version(early, 3)
    # A subscriber can finish receiving before the publisher's own broadcast call returns and counts it.
    wait_for(lambda: bus.pub.stats()["sent_version"] == 3, what="the publisher's count of v3")
    sends = bus.pub.stats()["sends"]
    late = bus.sub("late")
    t0 = time.monotonic()
    update = wait_version(late, 3)
    assert time.monotonic() - t0 < 1.0, "a late joiner must not wait for the next version"
    assert_bit_equal(update.tensors, small_state(3), "cpu")
    # One re-send of v3 over the new epoch (the publisher counts it once its own broadcast returned).
    wait_for(lambda: bus.pub.stats()["sends"] >= sends + 1, what="the re-send")
    assert bus.pub.stats()["sends"] == sends + 1
    bus.pub.publish(4, small_state(4))
    for s in (early, late):
        assert wait_version(s, 4).version == 4


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_close_leaves_no_threads():
    def cycle() -> None:
        b = Bus()
        subs = [b.sub(f"g{i}") for i in range(2)]
        b.pub.publish(1, small_state(1))
        for s in subs:
            wait_version(s, 1)
        b.pub.publish(2, mixed_state())  # possibly still in flight while everything closes
        t0 = time.monotonic()
        b.close()
        assert time.monotonic() - t0 < TIMEOUT_S + 1

    # Warm up: ZeroMQ's context threads, gloo's and torch's pools are made once per process.
    cycle()
    cycle()
    python_before, native_before = set(threading.enumerate()), _native_threads()
    cycle()
    cycle()
    wait_for(lambda: _native_threads() <= native_before, timeout_s=5, what="native threads to end")
    assert set(threading.enumerate()) <= python_before


# --- subscribers in processes (gloo here, nccl on GPUs) ----------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_bucketed_round_trip_is_bit_exact_and_a_late_process_gets_the_newest(backend, pool):
    b = Bus(backend)
    try:
        local = b.sub("local")
        state = mixed_state()
        b.pub.publish(1, state)
        update = wait_version(local, 1)
        assert_bit_equal(update.tensors, state, str(local.device))
        assert update.nbytes == sum(t.numel() * t.element_size() for t in state.values())
        # Tensors are views of the received buckets (several share one bucket's storage).
        storages = {t.untyped_storage().data_ptr() for t in update.tensors.values() if t.numel()}
        assert len(storages) < len([t for t in update.tensors.values() if t.numel()])
        # A process that joins now gets version 1 without a new publish.
        child = b.spawn(pool, "child")
        report = read_until(child, 1)
        assert report["checksum"] == state_dict_checksum(state) and report["device"] == child.device
        # publish copies: changing the caller's tensors afterwards changes nothing that is sent.
        state2 = {k: t.to(b.device) for k, t in mixed_state(seed=10).items()}
        want = state_dict_checksum({k: t.cpu() for k, t in state2.items()})
        b.pub.publish(2, state2)
        for t in state2.values():
            t.zero_()
        assert state_dict_checksum({k: t.cpu() for k, t in wait_version(local, 2).tensors.items()}) == want
        assert read_until(child, 2)["checksum"] == want
        assert local.rejected == 0
        # A subscriber that already has the newest version is not handed it again.
        local.close()  # (with nccl: frees its GPU for the next one)
        current = b.sub("current", have=2)
        assert current.poll(timeout_ms=300) is None and current.latest_version == 2
    finally:
        b.close()


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
def test_nccl_factories():
    cfg = NcclWeightsConfig(bucket_mb=1, timeout_s=TIMEOUT_S)
    torch.cuda.set_device(0)
    pub = setup_publisher(cfg)
    torch.cuda.set_device(1)
    sub = setup_subscriber(cfg, pub.address, "g0", have=0)
    torch.cuda.set_device(0)
    try:
        pub.publish(1, {k: t.cuda() for k, t in mixed_state().items()})
        assert_bit_equal(wait_version(sub, 1, timeout_s=30).tensors, mixed_state(), "cuda:1")
    finally:
        sub.close()
        pub.close()


def test_sigkilled_subscriber_does_not_block_the_publisher_or_the_others(bus, pool):
    healthy = bus.sub("healthy")
    victim = bus.spawn(pool, "victim")
    bus.pub.publish(1, small_state(1))
    read_until(victim, 1)
    wait_version(healthy, 1)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    t0 = time.monotonic()
    worst = 0.0
    for v in range(2, 7):
        t = time.monotonic()
        bus.pub.publish(v, small_state(v))
        worst = max(worst, time.monotonic() - t)
    assert worst < 0.2, f"publish took {worst:.2f}s: it must only snapshot"
    assert_bit_equal(wait_version(healthy, 6).tensors, small_state(6), "cpu")
    recovered = time.monotonic() - t0
    # Noticed by the closed connection, not by a timeout.
    assert recovered < TIMEOUT_S, f"the others waited {recovered:.1f}s"
    wait_for(lambda: bus.pub.stats()["subscribers"] == 1, what="the victim dropped")


def test_stopped_subscriber_is_dropped_after_the_timeout_and_rejoins_when_resumed(bus, pool):
    healthy = bus.sub("healthy")
    sleeper = bus.spawn(pool, "sleeper")
    bus.pub.publish(1, small_state(1))
    read_until(sleeper, 1)
    wait_version(healthy, 1)
    sleeper.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    bus.pub.publish(2, small_state(2))
    wait_version(healthy, 2)
    stalled = time.monotonic() - t0
    assert stalled < 2 * TIMEOUT_S + 1, f"a stopped subscriber stalled the others {stalled:.1f}s"
    sleeper.send_signal(signal.SIGCONT)
    # Its broadcast failed and it was dropped; its hello re-admits it and it gets the newest.
    assert read_until(sleeper, 2)["checksum"] == state_dict_checksum(small_state(2))
    bus.pub.publish(3, small_state(3))
    wait_version(healthy, 3)
    read_until(sleeper, 3)
