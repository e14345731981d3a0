"""Shared-memory weight bus over real /dev/shm files, with subscribers and publishers in real
separate processes where it matters (late joiners, SIGKILLed subscribers and publishers)."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
from weights_common import random_bits, raw

from asyncrl.config import ShmWeightsConfig, ZmqWeightsConfig
from asyncrl.weights import (
    ShmWeightPublisher,
    ShmWeightSubscriber,
    remove_stale_shm,
    setup_publisher,
    setup_subscriber,
    state_dict_checksum,
)
from asyncrl.weights.shm_layout import HEADER, MAGIC
from asyncrl.weights.wire import tensor_digest

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a Linux /dev/shm")

ROOT = Path(__file__).resolve().parents[2]

# A child process: a subscriber ("sub": first poll, report, hold the mapping until stdin closes) or a
# publisher ("pub-exit": publish and return normally; "pub-hang": publish and wait to be killed).
CHILD = r"""
import json, os, sys, time
import torch
from asyncrl.weights import ShmWeightPublisher, ShmWeightSubscriber, state_dict_checksum
mode, arg = sys.argv[1], sys.argv[2]
if mode == "sub":
    sub = ShmWeightSubscriber(arg, "child")
    t0 = time.monotonic()
    update = sub.poll(timeout_ms=0)  # the first poll, no waiting
    elapsed = time.monotonic() - t0
    maps = [line.split() for line in open("/proc/self/maps") if sub.address[6:] in line]
    print(json.dumps({"version": update and update.version, "elapsed": elapsed,
                      "checksum": update and state_dict_checksum(update.tensors),
                      "maps": [{"path": m[-1], "inode": int(m[4])} for m in maps]}), flush=True)
    sys.stdin.read()  # hold the mapping until told (or killed)
else:
    pub = ShmWeightPublisher(arg, bucket_bytes=1 << 16)
    pub.publish(1, {"w": torch.arange(1000, dtype=torch.float32)})
    while pub.stats()["latest"] < 1:
        time.sleep(0.01)
    print(json.dumps({"address": pub.address}), flush=True)
    if mode == "pub-hang":
        time.sleep(600)
"""


def spawn(mode: str, arg: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, arg],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def read_json(proc: subprocess.Popen, timeout_s: float = 60.0) -> dict:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"child {proc.pid} said nothing in {timeout_s}s"
    line = proc.stdout.readline()
    assert line, f"child {proc.pid} exited with {proc.wait()}"
    return json.loads(line)


def end(proc: subprocess.Popen) -> None:
    """Stop a child this test started, by its pid."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    for stream in (proc.stdin, proc.stdout):
        if stream:
            stream.close()


@pytest.fixture
def root():
    """A private tmpfs directory to publish under; nothing may be left in it afterwards."""
    path = tempfile.mkdtemp(prefix="asyncrl-test-", dir="/dev/shm")
    yield path
    leftovers = os.listdir(path)
    shutil.rmtree(path, ignore_errors=True)
    assert leftovers == [], f"left behind in {path}: {leftovers}"


def mixed_state() -> dict[str, torch.Tensor]:
    wide = random_bits(torch.float32, (48, 64), 3)
    return {
        "embed.weight": random_bits(torch.float32, (300, 40), 1),  # 48000 B: bigger than a bucket
        "layer.0.attn.weight": random_bits(torch.bfloat16, (64, 96), 2),
        "layer.0.mlp.weight.T": wide.t(),  # non-contiguous
        "layer.0.mlp.rows": wide[::3, 5:40],  # strided slice
        "positions": torch.arange(-500, 500, dtype=torch.int64).reshape(10, 100),
        "mask": random_bits(torch.uint8, (77,), 4) > 127,
        "scale": torch.tensor(0.125),  # 0-d
        "empty": torch.empty(0, 7),
    }


def wait_sealed(pub: ShmWeightPublisher, version: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pub.stats()["latest"] < version:
        assert time.monotonic() < deadline, f"version {version} not sealed in {timeout_s}s"
        time.sleep(0.01)


def wait_version(sub, version: int, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    last = None
    while sub.latest_version < version:
        assert time.monotonic() < deadline, f"timed out at version {sub.latest_version}, want {version}"
        last = sub.poll(timeout_ms=100) or last
    return last


# --- round trip ----------------------------------------------------------------------------------
@pytest.mark.parametrize("verify", ["structure", "full"])
def test_bucketed_round_trip_is_bit_exact_and_zero_copy(root, verify):
    state = mixed_state()
    want = {name: raw(t) for name, t in state.items()}
    with ShmWeightPublisher(root, bucket_bytes=4096) as pub:
        sub = ShmWeightSubscriber(pub.address, "g0", verify=verify)
        pub.publish(1, state)
        for t in state.values():  # publish copied: the caller may change its tensors at once
            t.zero_()
        update = wait_version(sub, 1)
        assert update.version == 1 and sub.rejected == 0
        assert sorted(update.tensors) == sorted(want)
        for name, t in update.tensors.items():
            src = mixed_state()[name]
            assert (t.dtype, t.shape, t.device.type) == (src.dtype, src.shape, "cpu"), name
            assert raw(t) == want[name], name
        assert update.checksum == state_dict_checksum(mixed_state()) == state_dict_checksum(update.tensors)
        assert update.nbytes == sum(len(b) for b in want.values())
        # Zero copy: every non-empty tensor is a view of one storage, the mapping of the file.
        storages = {t.untyped_storage().data_ptr() for t in update.tensors.values() if t.numel()}
        assert len(storages) == 1
        # Writes stay private to this process (MAP_PRIVATE): a second subscriber sees the file.
        update.tensors["positions"].fill_(7)
        with ShmWeightSubscriber(pub.address, "g1", verify=verify) as other:
            assert raw(other.poll().tensors["positions"]) == want["positions"]
        sub.close()


def test_held_versions_are_never_overwritten_while_versions_race(root):
    """A reader polls as fast as 60 versions arrive and keeps its last three: what it holds never
    changes under it (files are reused only when no one maps them) and versions only increase."""
    with ShmWeightPublisher(root, bucket_bytes=1 << 14) as pub:
        sub = ShmWeightSubscriber(pub.address, "g0")
        done = threading.Event()
        seen, held, errors = [], [], []

        def read() -> None:
            deadline = time.monotonic() + 20
            while (not done.is_set() or sub.latest_version < 60) and time.monotonic() < deadline:
                update = sub.poll(timeout_ms=50)
                if update is None:
                    continue
                seen.append(update.version)
                held.append(update)
                del held[:-3]
                for u in held:
                    if not torch.all(u.tensors["w"] == u.version):
                        errors.append(u.version)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        for v in range(1, 61):
            pub.publish(v, {"w": torch.full((4, 4096), float(v)), "b": torch.full((100,), float(v))})
        done.set()
        reader.join(timeout=20)
        assert not reader.is_alive()
        assert errors == []
        assert seen == sorted(set(seen)) and seen[-1] == 60
        assert pub.stats()["spares"] <= 2
        sub.close()


# --- corruption ----------------------------------------------------------------------------------
def _forge(pub: ShmWeightPublisher, version: int, case: str) -> None:
    """Write a hand-made (bad) ``v<version>.wts`` from the live file, atomically like the publisher."""
    (live,) = [p for p in Path(pub.dir).iterdir() if p.name.endswith(".wts")]
    data = bytearray(live.read_bytes())
    _, moff, mlen, _, _, _ = HEADER.unpack_from(data)
    manifest = msgpack.unpackb(bytes(data[moff : moff + mlen]))
    manifest["version"] = version
    first = manifest["tensors"][0]
    if case == "shape mismatch":
        first["shape"] = [first["shape"][0] + 1, *first["shape"][1:]]
    elif case == "tensor outside its bucket":
        first["offset"] = 1 << 30
    elif case == "bucket outside the data region":
        manifest["buckets"][0]["offset"] = moff
    packed = msgpack.packb(manifest)
    body = bytes(data[:moff]) + packed
    digest = tensor_digest(packed)  # the header's manifest digest, as the publisher writes it
    header = HEADER.pack(MAGIC, moff, len(packed), digest, version, len(body))
    if case == "bad magic":
        header = b"asyncrl.shmw/0\0\0" + header[16:]
    elif case == "manifest digest mismatch":
        header = HEADER.pack(MAGIC, moff, len(packed), bytes(16), version, len(body))
    body = bytearray(header + body[len(header) :])
    if case == "flipped data byte":
        body[4096 + first["offset"] + 1] ^= 0x10
    elif case == "truncated file":
        body = body[:-1]
    tmp = Path(pub.dir, ".forged")
    tmp.write_bytes(body)
    os.rename(tmp, Path(pub.dir, f"v{version}.wts"))


# Each forged case and the reason its rejection names: the case is caught by its own check.
STRUCTURAL = {
    "truncated file": "header says",
    "shape mismatch": "does not match",
    "tensor outside its bucket": "outside bucket",
    "bucket outside the data region": "outside the data region",
    "bad magic": "unknown file magic",
    "manifest digest mismatch": "manifest digest mismatch",
}


@pytest.mark.parametrize("verify", ["structure", "full"])
def test_corrupted_files_are_rejected_and_the_old_version_kept(root, verify, caplog):
    cases = {**STRUCTURAL, **({"flipped data byte": "checksum mismatch"} if verify == "full" else {})}  # shm_bus
    state = {"a": torch.randn(64, 64), "b": torch.arange(100)}
    with ShmWeightPublisher(root, bucket_bytes=1 << 14) as pub:
        sub = ShmWeightSubscriber(pub.address, "g0", verify=verify)
        pub.publish(1, state)
        assert wait_version(sub, 1).checksum == state_dict_checksum(state)
        for i, (case, reason) in enumerate(cases.items(), start=1):
            _forge(pub, 1 + i, case)
            caplog.clear()
            assert sub.poll(timeout_ms=0) is None, case
            assert reason in caplog.text, (case, caplog.text)
            assert (sub.rejected, sub.latest_version) == (i, 1), case
            assert sub.poll(timeout_ms=0) is None and sub.rejected == i  # never re-counted
            os.unlink(Path(pub.dir, f"v{1 + i}.wts"))
        assert "rejected version" in caplog.text and "keeping version 1" in caplog.text
        # Newest first: a bad newest file does not hide a good older one that is newer than ours.
        pub.publish(50, state)
        wait_sealed(pub, 50)
        _forge(pub, 51, "shape mismatch")
        update = sub.poll(timeout_ms=0)
        assert update is not None and update.version == 50 and sub.rejected == len(cases) + 1
        assert update.checksum == state_dict_checksum(state) == state_dict_checksum(update.tensors)
        os.unlink(Path(pub.dir, "v51.wts"))
        sub.close()


# --- processes -----------------------------------------------------------------------------------
def test_late_subscriber_processes_get_newest_on_first_poll_and_map_one_file(root):
    state = {f"layer.{i}.w": torch.randn(256, 256) for i in range(4)}
    with ShmWeightPublisher(root, bucket_bytes=1 << 18) as pub:
        for v in range(1, 4):
            pub.publish(v, {**state, "step": torch.tensor(v)})
        wait_sealed(pub, 3)
        children = [spawn("sub", pub.address) for _ in range(2)]
        try:
            reports = [read_json(c) for c in children]
            live = Path(pub.dir, "v3.wts")
            inode = live.stat().st_ino
            for r in reports:
                assert r["version"] == 3, "a late joiner gets the newest version on its first poll"
                assert r["elapsed"] < 1.0
                assert r["checksum"] == state_dict_checksum({**state, "step": torch.tensor(3)})
                # Both processes map the very file the publisher wrote (same inode), not copies.
                assert {m["path"] for m in r["maps"]} == {str(live)}
                assert {m["inode"] for m in r["maps"]} == {inode}
            assert pub.stats()["versions"] <= 3  # v2 may have been superseded before it was sealed
        finally:
            for c in children:
                end(c)


def test_sigkilled_subscriber_does_not_block_the_publisher(root):
    state = {f"w{i}": torch.randn(256, 1024) for i in range(4)}  # 4 MiB

    def publish_all(versions) -> float:
        worst = 0.0
        for v in versions:
            state["w0"][0, 0] = v
            t0 = time.monotonic()
            pub.publish(v, state)
            worst = max(worst, time.monotonic() - t0)
        return worst

    with ShmWeightPublisher(root, bucket_bytes=1 << 20) as pub:
        pub.publish(1, state)
        wait_sealed(pub, 1)
        child = spawn("sub", pub.address)
        try:
            report = read_json(child)
            assert report["version"] == 1 and report["maps"], "the child holds a mapping of version 1"
            assert publish_all(range(2, 8)) < 3.0  # the held file is pinned, not waited for
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
            created = pub.stats()["files_created"]
            assert publish_all(range(8, 20)) < 3.0
            # At most three files are ever in use (live, sealing, being written) and at least the live
            # one exists after the kill: twelve versions need at most two new files if files are reused.
            assert pub.stats()["files_created"] <= created + 2, "files are reused once nobody maps them"
            assert pub.stats()["spares"] <= 2
            late = ShmWeightSubscriber(pub.address, "late")
            update = wait_version(late, 19)
            assert update.checksum == state_dict_checksum(state)
            late.close()
        finally:
            end(child)


def test_close_and_exit_remove_everything_and_cleanup_removes_killed_publishers(root):
    cfg = ShmWeightsConfig(bucket_mb=1, dir=root)
    pub = setup_publisher(cfg)
    sub = setup_subscriber(cfg, pub.address, "g0")
    pub.publish(1, {"w": torch.arange(10.0)})
    held = wait_version(sub, 1)
    exiting, hanging = spawn("pub-exit", root), spawn("pub-hang", root)
    try:
        exit_dir = read_json(exiting)["address"].removeprefix("shm://")
        hang_dir = read_json(hanging)["address"].removeprefix("shm://")
        assert exiting.wait(timeout=30) == 0
        assert not os.path.exists(exit_dir), "normal interpreter exit removes the directory"
        hanging.send_signal(signal.SIGKILL)
        hanging.wait(timeout=10)
        assert os.path.isdir(hang_dir)  # a killed publisher cannot clean up after itself...
        assert remove_stale_shm(root) == [hang_dir]  # ...the launcher's cleanup does; ours is alive
        assert os.path.isdir(pub.dir)
    finally:
        end(exiting)
        end(hanging)
    pub.close()
    assert not os.path.exists(pub.dir)
    assert torch.equal(held.tensors["w"], torch.arange(10.0))  # still mapped, memory still valid
    sub.close()
    # The same with the default root, /dev/shm itself.
    pub = setup_publisher(ShmWeightsConfig())
    assert pub.address.startswith("shm:///dev/shm/asyncrl-w-")
    pub.close()
    assert not os.path.exists(pub.dir)


def test_remove_stale_shm_leaves_live_and_foreign_directories(root):
    Path(root, "asyncrl-w-1-dead").mkdir()
    Path(root, "asyncrl-w-1-dead", "owner.json").write_text(json.dumps({"pid": os.getpid(), "start": -5}))
    Path(root, "asyncrl-w-999999999-x").mkdir()  # no owner.json: the pid in the name decides
    Path(root, "unrelated").mkdir()
    with ShmWeightPublisher(root) as pub:
        removed = remove_stale_shm(root)
        assert sorted(removed) == sorted([f"{root}/asyncrl-w-1-dead", f"{root}/asyncrl-w-999999999-x"])
        assert os.path.isdir(pub.dir)
        assert remove_stale_shm(root, alive=lambda pid, start: False) == [str(pub.dir)]
    os.rmdir(Path(root, "unrelated"))


# --- factories -----------------------------------------------------------------------------------
def test_factories_and_config(root):
    cfg = ShmWeightsConfig(bucket_mb=1, dir=root, verify="full")
    pub = setup_publisher(cfg)
    sub = setup_subscriber(cfg, pub.address, "g0", have=0)
    try:
        assert isinstance(pub, ShmWeightPublisher) and isinstance(sub, ShmWeightSubscriber)
        assert sub.verify == "full" and pub.address == f"shm://{pub.dir}"
        pub.publish(0, {"w": torch.zeros(3)})  # the subscriber already has version 0
        pub.publish(1, {"w": torch.ones(3)})
        assert wait_version(sub, 1).version == 1
        assert sub.poll(timeout_ms=50) is None
    finally:
        sub.close()
        pub.close()
    with pytest.raises(ValueError):
        setup_publisher(cfg, "tcp://127.0.0.1:*")
    with pytest.raises(ValueError):
        ShmWeightsConfig(verify="sometimes")
    explicit = setup_publisher(ShmWeightsConfig(), f"shm://{root}")  # an shm:// address of its own
    assert isinstance(explicit, ShmWeightPublisher)
    explicit.close()
    with pytest.raises(ValueError, match="weights.type=zmq speaks"):  # the address picks no transport
        setup_publisher(ZmqWeightsConfig(), f"shm://{root}")


def test_header_layout_is_64_bytes():
    assert HEADER.size == 64 and len(MAGIC) == 16 and struct.calcsize("<16sQQ16sQQ") == 64
