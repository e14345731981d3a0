"""Collective weight bus: versions are broadcast in buckets from learner rank 0 over a process
group of its own (NCCL on CUDA tensors in production, gloo on CPU tensors in tests; same code).

Two planes:

- Control, over ZeroMQ (a ROUTER on the publisher, a DEALER per subscriber, msgpack, never
  pickle; ``tcp://`` only, since the data plane is TCP anyway)::

    subscriber -> publisher  [b"hello", {"id": str, "have": int,
                                         "epoch": int,    # its group's epoch, -1: none
                                         "seen": int}]    # the last epoch it was told to join
                             [b"bye",   {"id": str}]
    publisher -> subscriber  [b"ping",  {}]               # reachability probe, ignored
                             [b"epoch", {"epoch": int, "rank": int, "world": int, "store_port": int}]
                             [b"version", manifest]

    manifest = {"epoch": int, "version": int, "created_at": float,
                "tensors": [<entries of wire.plan: name, dtype, shape, bucket, offset, nbytes>],
                "buckets": [{"nbytes": int, "checksum": str}, ...]}

- Data: a process group built for weight transfer only (never the default group, which the
  learner's DeepSpeed owns), rendezvousing through a ``TCPStore`` the publisher hosts. Rank 0 is
  the publisher, ranks 1..world-1 the members in join order. Each bucket is broadcast from rank 0
  as one flat uint8 tensor on the device, padded to a multiple of ``ALIGN`` bytes.

Membership is fixed per epoch, never per job (AReaL's limit): a join (hello), a leave (bye) or a
failed collective makes the publisher form a new group of the current members under the next
epoch; it pings the members (ZeroMQ reports a closed connection at once), tells each live one its
rank, waits for every member to report in the store, builds its end and re-sends its newest
version at once. That is how a late joiner gets the newest version; it costs one broadcast to
every member (those that already have it receive and discard it). A member that does
not report within ``timeout_s`` (stopped, dead) is dropped; when it comes back its next hello
re-admits it, and a member that lost the current epoch's group says so in a hello (epoch -1, seen
= current), which makes the publisher re-form; a hello about an older epoch is stale and ignored.

Verification (``bucket_checksums``) runs on the device, so GPU bytes are never copied to the host:
per bucket, two wrapping int64 sums over its int32 words w_i, sum(w_i) and sum((i+1) * w_i).
This catches any change confined to one word, swapped or shifted words (almost surely), and any
size change (sizes are checked separately); it is an integrity check for the transport, not a
cryptographic one (a forger, or errors that cancel in both sums, pass). The manifest is checked
(schema, dtypes, shapes against nbytes, extents, alignment) before tensors are built as views of
the received buckets, on the device. ``WeightUpdate.checksum`` is this bus's digest of the
manifest and bucket sums, not ``state_dict_checksum`` (which would need every byte on the host).

Concurrency: each end has one background thread that owns its ZeroMQ socket and its group.
``publish`` copies the state dict into fresh device buckets in the caller's thread (on CUDA it only
queues the copy and records an event), leaves them in a one-slot mailbox (a newer version replaces
an unsent one) and returns; the publisher thread checksums and broadcasts. The subscriber thread
receives into buffers of its own and leaves the newest verified version in a slot that ``poll``
takes, so a generator busy in its engine delays nobody. Every collective waits at most
``timeout_s``, in the background threads only. A dead member is noticed at once (its connections
close: the ping or the broadcast fails) and the others go on after one re-formation (~0.1 s on
loopback); a stopped or hung one stalls them about 2 x ``timeout_s`` (the broadcast times out,
then it does not report for the next epoch and is dropped). ``close`` takes at most ``timeout_s``
(a group rendezvous in progress cannot be interrupted). The publisher's device memory holds
at most three versions (one being sent, one pending, one being copied by ``publish``); a
subscriber's, two or three (the one it applied and still holds, the one in the slot, the one
arriving).

NCCL specifics (the gloo path is what the CPU tests run): every rank of a group needs a GPU of
its own (NCCL refuses two ranks on one device), so the learner rank 0 and the generators must sit
on different GPUs. The communicator of an epoch is made lazily by its first broadcast, which
blocks the background thread until every member has called it; a member that dies in that
instant (after reporting for the epoch) can hold it longer than ``timeout_s``. A stuck broadcast
is aborted by us after ``timeout_s``, before NCCL's own watchdog (set to 2 x ``timeout_s`` +
30 s) would tear the process down.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import msgpack
import torch
import torch.distributed as dist
import zmq

from asyncrl.weights.base import Wakeup, WeightPublisher, WeightSubscriber, check_publish, log, log_rejection
from asyncrl.weights.wire import ALIGN, DTYPES, WeightsRejected, WeightUpdate, check_entries, plan
from asyncrl.weights.zmq_bus import bus_context

# Publisher/subscriber thread tick when idle: bounds how late a hello, bye or close is noticed.
_IDLE_MS = 100
# Sleep between completion checks of a running collective (cheap; keeps close() responsive).
_SPIN_S = 0.0005
# int32 words per checksum step: bounds the device scratch memory to ~3 x 32 MiB per step.
_CHUNK_WORDS = 1 << 22
_MASK = (1 << 64) - 1
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def bucket_checksums(buckets: list[torch.Tensor]) -> list[str]:
    """Per bucket (uint8, length a multiple of 4): hex of sum(w_i) and sum((i+1) w_i) mod 2**64
    over its int32 words, computed where the bucket lives; one 16-byte transfer per bucket."""
    sums = []
    for bucket in buckets:
        words = bucket.view(torch.int32)
        acc = torch.zeros(2, dtype=torch.int64, device=bucket.device)
        for start in range(0, words.numel(), _CHUNK_WORDS):
            w = words[start : start + _CHUNK_WORDS].to(torch.int64)
            pos = torch.arange(start + 1, start + 1 + w.numel(), dtype=torch.int64, device=bucket.device)
            acc[0] += w.sum()
            acc[1] += (w * pos).sum()  # wraps mod 2**64, identically on every device
        sums.append(acc)
    host = torch.stack(sums).cpu().tolist() if sums else []
    return [f"{s & _MASK:016x}{p & _MASK:016x}" for s, p in host]


def digest(manifest: dict) -> str:
    """``WeightUpdate.checksum`` of this bus: blake2b-128 over the tensor entries and bucket sums."""
    body = [manifest["tensors"], [b["checksum"] for b in manifest["buckets"]]]
    return hashlib.blake2b(msgpack.packb(body), digest_size=16).hexdigest()


@dataclasses.dataclass
class DeviceSnapshot:
    version: int
    entries: list[dict]
    sizes: list[int]  # unpadded bucket sizes, as planned
    buckets: list[torch.Tensor]  # uint8 (padded(size),) on the device
    copied: torch.cuda.Event | None  # recorded after the copies (CUDA only)
    created_at: float


def device_snapshot(version: int, state_dict: dict[str, torch.Tensor], bucket_bytes: int, device) -> DeviceSnapshot:
    if not all(isinstance(k, str) for k in state_dict):
        raise TypeError("state dict names must be strings")
    device = torch.device(device)
    entries, sizes = plan(state_dict, bucket_bytes)
    buckets = [torch.zeros(padded(n), dtype=torch.uint8, device=device) for n in sizes]
    for e in entries:
        if e["nbytes"]:
            src = state_dict[e["name"]].detach().reshape(-1).view(torch.uint8)
            buckets[e["bucket"]][e["offset"] : e["offset"] + e["nbytes"]].copy_(src)
    copied = None
    if device.type == "cuda":
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(device))
    return DeviceSnapshot(int(version), entries, sizes, buckets, copied, time.time())


def check_manifest(m: object) -> list[int]:
    """The padded bucket sizes to receive; raises ``WeightsRejected`` if even those are unclear."""
    if not isinstance(m, dict):
        raise WeightsRejected("manifest is not a map")
    for key, typ in (("version", int), ("epoch", int), ("tensors", list), ("buckets", list)):
        if not isinstance(m.get(key), typ):
            raise WeightsRejected(f"manifest field {key!r} missing or not {typ.__name__}")
    for i, b in enumerate(m["buckets"]):
        if not (isinstance(b, dict) and isinstance(b.get("nbytes"), int) and b["nbytes"] >= 0):
            raise WeightsRejected(f"bucket {i}: bad entry {b!r:.80}")
        if not isinstance(b.get("checksum"), str):
            raise WeightsRejected(f"bucket {i}: checksum missing")
    return [padded(b["nbytes"]) for b in m["buckets"]]


def build_update(m: dict, buckets: list[torch.Tensor], device: torch.device) -> WeightUpdate:
    """Verify received buckets against the manifest; tensors are views of the buckets."""
    check_entries(m["tensors"], [b["nbytes"] for b in m["buckets"]])
    for i, (meta, got) in enumerate(zip(m["buckets"], bucket_checksums(buckets), strict=True)):
        if got != meta["checksum"]:
            raise WeightsRejected(f"bucket {i}: checksum mismatch")
    tensors = {}
    for e in m["tensors"]:
        dtype, (b, off, n) = DTYPES[e["dtype"]], (e["bucket"], e["offset"], e["nbytes"])
        if n:
            tensors[e["name"]] = buckets[b][off : off + n].view(dtype).view(e["shape"])
        else:
            tensors[e["name"]] = torch.empty(e["shape"], dtype=dtype, device=device)
    return WeightUpdate(
        version=m["version"],
        tensors=tensors,
        checksum=digest(m),
        nbytes=sum(e["nbytes"] for e in m["tensors"]),
        received_at=time.time(),
        published_at=float(m.get("created_at", 0.0) or 0.0),
    )


class Group:
    """One epoch's process group (rank 0 = publisher); built directly, never registered with
    ``torch.distributed``'s default group or group registry."""

    def __init__(self, backend: str, store, epoch: int, rank: int, world: int, host: str | None, timeout_s: float):
        self.epoch, self.rank, self.world = epoch, rank, world
        prefix = dist.PrefixStore(f"asyncrl.weights/e{epoch}/", store)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = datetime.timedelta(seconds=timeout_s)
            gloo = dist.ProcessGroupGloo
            opts._devices = [gloo.create_device(hostname=host) if host else gloo.create_default_device()]
            self.pg = gloo(prefix, rank, world, opts)  # rendezvous: returns when all ranks connected
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            # Longer than our own deadline: we abort a stuck group before NCCL's watchdog would.
            opts._timeout = datetime.timedelta(seconds=2 * timeout_s + 30)
            self.pg = dist.ProcessGroupNCCL(prefix, rank, world, opts)  # communicator made on first use
        else:
            raise ValueError(f"unknown collective backend {backend!r}")

    def broadcast(self, tensor: torch.Tensor, timeout_s: float, stop: Callable[[], bool]) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        work = self.pg.broadcast([tensor], opts)
        try:
            deadline = time.monotonic() + timeout_s
            while not work.is_completed():
                if stop():
                    raise RuntimeError("closing")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"broadcast of {tensor.numel()} bytes took over {timeout_s}s")
                time.sleep(_SPIN_S)
            work.wait()  # raises the collective's error; on CUDA orders the current stream after it
        finally:
            del work  # a traceback kept in a log record must not keep the group's connections alive

    def close(self) -> None:
        try:
            self.pg.abort()
        except Exception:  # noqa: BLE001 - best effort: a group may be half made or already failed
            pass
        self.pg = None


def resolve_device(device: str | torch.device) -> torch.device:
    """``cuda`` means the caller's current GPU, fixed now: the background thread starts on cuda:0."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def split_tcp(address: str) -> tuple[str, int]:
    parts = urlsplit(address)
    if parts.scheme != "tcp" or not parts.hostname:
        raise ValueError(f"the collective weight bus needs a tcp:// control address, not {address!r}")
    return parts.hostname, parts.port or 0


def gloo_host(host: str) -> str | None:
    """Interface for gloo: loopback stays loopback; otherwise gloo's default (GLOO_SOCKET_IFNAME)."""
    return "127.0.0.1" if host in LOOPBACK else None


@dataclasses.dataclass
class _Member:
    name: str
    have: int  # newest version it holds, as far as the publisher knows


class CollectiveWeightPublisher(WeightPublisher):
    def __init__(
        self,
        address: str = "tcp://127.0.0.1:*",
        backend: str = "nccl",
        device: str | torch.device = "cuda",
        bucket_bytes: int = 64 << 20,
        timeout_s: float = 30.0,
    ) -> None:
        host, _ = split_tcp(address.replace(":*", ":0"))
        self.backend, self.device = backend, resolve_device(device)
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self._gloo_host = gloo_host(host)
        sock = bus_context().socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, -1)  # see bus_context: a finite linger can abort the process
        sock.bind(address)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock  # from here on only the thread touches it
        timeout = datetime.timedelta(seconds=timeout_s)
        # The store listens on every interface; the host is where its own client connects.
        store_host = "127.0.0.1" if host in ("*", "0.0.0.0") else host
        self._store = dist.TCPStore(store_host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        self._lock = threading.Lock()
        self._pending: DeviceSnapshot | None = None
        self._last_version: int | None = None
        self._closing = False
        self._wakeup = Wakeup()  # publish -> thread: a version is pending
        # Thread state.
        self._members: dict[bytes, _Member] = {}
        self._group: Group | None = None
        self._group_members: list[bytes] = []
        self._epoch = 0
        self._dirty = False  # membership changed or the group failed: form a new one
        self._newest: tuple[DeviceSnapshot, list[str]] | None = None
        self._tamper: Callable[[dict, list[torch.Tensor]], list[torch.Tensor]] | None = None  # tests only
        # sent_version: the newest version whose broadcast completed on the publisher's side
        self._stats = {"versions": 0, "sends": 0, "sent_version": -1, "epochs": 0, "failures": 0, "dropped": 0}
        self._thread = threading.Thread(target=self._run, name="weights-collective-pub", daemon=True)
        self._thread.start()

    # --- caller side ---------------------------------------------------------------------------
    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        check_publish(version, self._last_version, self._closing)
        snap = device_snapshot(version, state_dict, self.bucket_bytes, self.device)
        with self._lock:
            self._pending = snap
            self._last_version = version
        self._wakeup.set()

    def stats(self) -> dict[str, int]:
        return {**self._stats, "subscribers": len(self._members), "epoch": self._epoch}

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._thread.join()  # bounded: collectives stop on _closing, control waits are _IDLE_MS
        self._sock.close()
        self._wakeup.close()
        self._store = None

    # --- background thread ---------------------------------------------------------------------
    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        while not self._closing:
            events = dict(poller.poll(_IDLE_MS))
            try:
                if self._wakeup.fd in events:
                    self._wakeup.clear()
                    self._take_pending()
                if self._sock in events:
                    self._handle_control()
                if self._dirty and not self._closing:
                    self._form_group()
                if self._group is not None and self._lagging():
                    self._send_newest()
            except Exception:  # noqa: BLE001 - the bus must outlive one bad message or version
                log.exception("weights: collective publisher thread error")
        if self._group is not None:
            self._group.close()

    def _take_pending(self) -> None:
        with self._lock:
            snap, self._pending = self._pending, None
        if snap is None:
            return
        if snap.copied is not None:
            snap.copied.synchronize()
        self._newest = (snap, bucket_checksums(snap.buckets))
        self._stats["versions"] += 1

    def _handle_control(self) -> None:
        while True:
            try:
                ident, kind, body = self._sock.recv_multipart(zmq.NOBLOCK)
                body = msgpack.unpackb(body)
                name = str(body.get("id", "?"))
            except zmq.Again:
                return
            except Exception:  # noqa: BLE001 - malformed control message
                log.debug("weights: ignoring malformed control message")
                continue
            member = self._members.get(ident)
            if kind == b"bye":
                if self._members.pop(ident, None) is not None:
                    log.info("weights: subscriber %s left", name)
                    self._dirty = True
            elif kind == b"hello" and member is None:
                log.info("weights: subscriber %s joined (has version %s)", name, body.get("have"))
                self._members[ident] = _Member(name, int(body.get("have", -1)))
                self._dirty = True
            elif kind == b"hello" and self._lost_group(body):
                self._dirty = True

    def _lost_group(self, hello: dict) -> bool:
        """A member that was told to join the current group and is not in it (its collective failed)."""
        if self._group is None:
            return False  # none to lose; ``_dirty`` is already set if there are members
        return hello.get("epoch") != self._group.epoch and hello.get("seen", -1) >= self._group.epoch

    def _send(self, ident: bytes, kind: bytes, body: dict) -> bool:
        try:
            self._sock.send_multipart([ident, kind, msgpack.packb(body)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:  # EHOSTUNREACH: the connection is gone; EAGAIN: not reading at all
            return False

    def _drop(self, idents: list[bytes], why: str) -> None:
        for ident in idents:
            member = self._members.pop(ident, None)
            if member is not None:
                log.warning("weights: subscriber %s dropped (%s)", member.name, why)
                self._stats["dropped"] += 1

    def _form_group(self) -> None:
        """A new group of the current members under the next epoch; leaves ``_dirty`` set on failure."""
        if self._group is not None:
            self._group.close()
            self._group = None
        members = list(self._members)
        if not members:
            self._dirty = False
            return
        # Probe first: a member told to join a group that is then abandoned would wait out a timeout.
        unreachable = [m for m in members if not self._send(m, b"ping", {})]
        if unreachable:
            self._drop(unreachable, "unreachable")
            members = list(self._members)
            if not members:
                self._dirty = False
                return
        self._epoch += 1
        epoch, world = self._epoch, len(members) + 1
        port = self._store.port
        unreachable = [
            m for r, m in enumerate(members, 1) if not self._send(m, b"epoch", _epoch_msg(epoch, r, world, port))
        ]
        if unreachable:
            self._drop(unreachable, "unreachable")
            return
        keys = [arrived_key(epoch, r) for r in range(1, world)]
        missing = self._wait_arrived(members, keys)
        if self._closing:
            return
        if missing:
            self._drop(missing, f"did not join epoch {epoch} within {self.timeout_s}s")
            return
        try:
            self._group = Group(self.backend, self._store, epoch, 0, world, self._gloo_host, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - someone died during the rendezvous: try again
            log.warning("weights: forming epoch %d failed: %s", epoch, str(exc))
            self._stats["failures"] += 1
            return
        self._group_members, self._dirty = members, False
        self._stats["epochs"] += 1
        log.info("weights: epoch %d formed with %d subscribers", epoch, len(members))

    def _wait_arrived(self, members: list[bytes], keys: list[str]) -> list[bytes]:
        """Members whose arrival key is still missing after ``timeout_s`` (none: all arrived)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            missing = [m for m, k in zip(members, keys, strict=True) if not self._store.check([k])]
            if not missing or self._closing or time.monotonic() > deadline:
                return missing
            time.sleep(0.005)

    def _lagging(self) -> bool:
        if self._newest is None:
            return False
        version = self._newest[0].version
        return any(m in self._members and self._members[m].have < version for m in self._group_members)

    def _send_newest(self) -> None:
        snap, sums = self._newest
        group = self._group
        manifest = {
            "epoch": group.epoch,
            "version": snap.version,
            "created_at": snap.created_at,
            "tensors": snap.entries,
            "buckets": [{"nbytes": n, "checksum": c} for n, c in zip(snap.sizes, sums, strict=True)],
        }
        buckets = snap.buckets if self._tamper is None else self._tamper(manifest, snap.buckets)
        try:
            for kind, body in ((b"ping", {}), (b"version", manifest)):  # ping: nobody starts a doomed broadcast
                for m in self._group_members:
                    if not self._send(m, kind, body):
                        raise ConnectionError(f"subscriber {getattr(self._members.get(m), 'name', '?')} unreachable")
            for bucket in buckets:
                group.broadcast(bucket, self.timeout_s, lambda: self._closing)
        except Exception as exc:  # noqa: BLE001 - a member died or stalled: re-form without it
            if self._closing:
                return
            log.warning("weights: sending version %d over epoch %d failed: %s", snap.version, group.epoch, str(exc))
            self._stats["failures"] += 1
            group.close()
            self._group, self._dirty = None, True
            time.sleep(0.05)  # let ZeroMQ notice closed connections, so the next probe finds the dead
            return
        for m in self._group_members:
            if m in self._members:
                self._members[m].have = max(self._members[m].have, snap.version)
        self._stats["sends"] += 1
        self._stats["sent_version"] = snap.version


def arrived_key(epoch: int, rank: int) -> str:
    return f"asyncrl.weights/e{epoch}/arrived/{rank}"


def _epoch_msg(epoch: int, rank: int, world: int, port: int) -> dict:
    return {"epoch": epoch, "rank": rank, "world": world, "store_port": port}


class CollectiveWeightSubscriber(WeightSubscriber):
    def __init__(
        self,
        address: str,
        subscriber_id: str,
        have: int = -1,
        backend: str = "nccl",
        device: str | torch.device = "cuda",
        timeout_s: float = 30.0,
        rehello_s: float = 5.0,
    ) -> None:
        self.address, self.subscriber_id = address, subscriber_id
        self.latest_version, self.rejected = have, 0
        self.backend, self.device = backend, resolve_device(device)
        self.timeout_s, self.rehello_s = timeout_s, rehello_s
        self._host, _ = split_tcp(address)
        self._cond = threading.Condition()
        self._ready: WeightUpdate | None = None  # newest verified version not yet taken by poll
        self._newest = have  # newest version received (verified or not), thread side
        self._closed = False
        self._store = None
        self._store_port = 0
        self._seen_epoch = -1
        self._group: Group | None = None
        self._sock = bus_context().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 200)  # lets "bye" leave after close
        self._sock.connect(address)
        self._thread = threading.Thread(target=self._run, name="weights-collective-sub", daemon=True)
        self._thread.start()

    # --- caller side ---------------------------------------------------------------------------
    def poll(self, timeout_ms: int = 0) -> WeightUpdate | None:
        if self._closed:
            raise RuntimeError("poll on a closed weight subscriber")
        with self._cond:
            self._cond.wait_for(lambda: self._ready is not None, max(timeout_ms, 0) / 1000)
            update, self._ready = self._ready, None
        if update is None or update.version <= self.latest_version:
            return None
        self.latest_version = update.version
        return update

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._thread.join()  # bounded: collectives stop on _closed, control waits are _IDLE_MS

    # --- background thread ---------------------------------------------------------------------
    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._hello()
        while not self._closed:
            messages = []
            if self._sock.poll(_IDLE_MS, zmq.POLLIN):
                while True:
                    try:
                        messages.append(self._sock.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                self._last_contact = time.monotonic()
            elif time.monotonic() - self._last_contact > self.rehello_s:
                self._hello()
            try:
                self._handle(messages)
            except Exception:  # noqa: BLE001 - the bus must outlive one bad message
                log.exception("weights: collective subscriber thread error")
        self._leave_group()
        self._control(b"bye", {"id": self.subscriber_id})
        self._sock.close()

    def _control(self, kind: bytes, body: dict) -> None:
        try:
            self._sock.send_multipart([kind, msgpack.packb(body)], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # publisher unreachable for now; hello is repeated after rehello_s
        self._last_contact = time.monotonic()

    def _hello(self) -> None:
        epoch = self._group.epoch if self._group is not None else -1
        body = {"id": self.subscriber_id, "have": self._newest, "epoch": epoch, "seen": self._seen_epoch}
        self._control(b"hello", body)

    def _leave_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def _handle(self, messages: list[list[bytes]]) -> None:
        parsed = []
        for frames in messages:
            try:
                kind, body = frames[0], msgpack.unpackb(frames[1])
            except Exception:  # noqa: BLE001
                log.debug("weights: ignoring malformed message from the publisher")
                continue
            parsed.append((kind, body))
        # Only the newest epoch counts, and only what was sent for it.
        epochs = [i for i, (kind, _) in enumerate(parsed) if kind == b"epoch"]
        for kind, body in parsed[epochs[-1] :] if epochs else parsed:
            if self._closed:
                return
            if kind == b"epoch":
                self._join(body)
            elif kind == b"version" and self._group is not None and body.get("epoch") == self._group.epoch:
                self._receive(body)

    def _join(self, body: dict) -> None:
        self._leave_group()
        epoch, rank, world, port = (int(body[k]) for k in ("epoch", "rank", "world", "store_port"))
        self._seen_epoch = epoch
        try:
            if self._store is None or self._store_port != port:
                timeout = datetime.timedelta(seconds=self.timeout_s)
                self._store = dist.TCPStore(self._host, port, is_master=False, timeout=timeout)
                self._store_port = port
            self._store.set(arrived_key(epoch, rank), b"1")
            self._group = Group(self.backend, self._store, epoch, rank, world, gloo_host(self._host), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the publisher re-forms; our hello asks it to
            log.warning("weights: %s could not join epoch %d: %s", self.subscriber_id, epoch, str(exc))
            self._group = None
            self._hello()

    def _receive(self, manifest: dict) -> None:
        version = manifest.get("version")
        try:
            sizes = check_manifest(manifest)
        except WeightsRejected as exc:
            # Without bucket sizes we cannot take part in the broadcast: leave, ask for a new group.
            self._reject(version, str(exc))
            self._leave_group()
            self._hello()
            return
        buckets = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        try:
            for bucket in buckets:
                self._group.broadcast(bucket, self.timeout_s, lambda: self._closed)
        except Exception as exc:  # noqa: BLE001 - the group failed; the publisher re-forms it
            if not self._closed:
                log.warning(
                    "weights: %s lost version %s in epoch %d: %s",
                    self.subscriber_id,
                    version,
                    self._group.epoch,
                    str(exc),
                )
                self._leave_group()
                self._hello()
            return
        if version <= self._newest:
            return  # a re-send for a late joiner: we have it already
        try:
            update = build_update(manifest, buckets, self.device)
        except WeightsRejected as exc:
            self._reject(version, str(exc))
            return
        self._newest = update.version
        with self._cond:
            self._ready = update
            self._cond.notify_all()

    def _reject(self, version: object, reason: str) -> None:
        self.rejected += 1
        log_rejection(self.subscriber_id, version, reason, self._newest)
