"""Collective weight bus: versions are broadcast in buckets from learner rank 0 over a process group
of its own (NCCL on CUDA tensors in production, gloo on CPU tensors in tests; same code).

Two planes:

- Control: the ZeroMQ control plane of ``control_plane`` (``tcp://`` only, since the data plane is
  TCP anyway). A subscriber's hello carries two more fields, and the publisher sends three kinds::

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

  With the run secret the control plane is CURVE-authenticated (``curve``); the store and the
  process group below are not (they carry no weights from outside the group, but a local process
  could disturb a formation: keep the control address on a trusted network).

- Data: one broadcast per bucket from rank 0 over the epoch's group (``collective_group``), as one
  flat uint8 tensor on the device (``collective_buckets``: padding, checksums, verification).

Membership is fixed per epoch, never per job: a join (hello), a leave (bye) or a failed collective
makes the publisher form a new group of the current members under the next epoch; it pings the
members (ZeroMQ reports a closed connection at once), tells each live one its rank, waits for every
member to report in the store, builds its end and re-sends its newest version at once. That is how
a late joiner gets the newest version; it costs one broadcast to every member (those that already
have it receive and discard it). A member that does not report within ``timeout_s`` (stopped,
dead) is dropped; when it comes back its next hello re-admits it, and a member that lost the
current epoch's group says so in a hello (epoch -1, seen = current), which makes the publisher
re-form; a hello about an older epoch is stale and ignored.

Concurrency: each end has one background thread that owns its ZeroMQ socket and its group.
``publish`` copies the state dict into fresh device buckets in the caller's thread (on CUDA it only
queues the copy and records an event) and leaves them in the control plane's one-slot mailbox; the
publisher thread checksums and broadcasts. Every collective waits at most ``timeout_s``, in the
background threads only. A dead member is noticed at once (its connections close: the ping or the
broadcast fails) and the others go on after one re-formation; a stopped or hung one stalls them
about 2 x ``timeout_s`` (the broadcast times out, then it does not report for the next epoch and is
dropped). ``close`` takes at most ``timeout_s`` (a group rendezvous in progress cannot be
interrupted). The publisher's device memory holds at most three versions (one being sent, one
pending, one being copied by ``publish``).
"""

from __future__ import annotations

import datetime
import time

import msgpack
import torch
import torch.distributed as dist

from asyncrl.weights.base import log
from asyncrl.weights.collective_buckets import DeviceSnapshot, bucket_checksums, device_snapshot, manifest_of
from asyncrl.weights.collective_group import Group, arrived_key, gloo_host, resolve_device, split_tcp
from asyncrl.weights.control_plane import Peer, RouterPublisher

# Thread tick when idle: bounds how late a hello, bye or close is noticed.
IDLE_MS = 100


class CollectiveWeightPublisher(RouterPublisher[DeviceSnapshot]):
    def __init__(
        self,
        address: str = "tcp://127.0.0.1:*",
        backend: str = "nccl",
        device: str | torch.device = "cuda",
        bucket_bytes: int = 64 << 20,
        timeout_s: float = 30.0,
        secret: str | None = None,
    ) -> None:
        host, _ = split_tcp(address.replace(":*", ":0"))
        self.backend, self.device = backend, resolve_device(device)
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self._gloo_host = gloo_host(host)
        super().__init__(address, "weights-collective-pub", secret=secret)
        # The store listens on every interface; the host is where its own client connects.
        store_host = "127.0.0.1" if host in ("*", "0.0.0.0") else host
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(store_host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        # Thread state.
        self._group: Group | None = None
        self._group_members: list[bytes] = []
        self._epoch = 0
        self._dirty = False  # membership changed or the group failed: form a new one
        self._newest: tuple[DeviceSnapshot, list[str]] | None = None
        # sent_version: the newest version whose broadcast completed on the publisher's side
        self._stats = {"versions": 0, "sends": 0, "sent_version": -1, "epochs": 0, "failures": 0, "dropped": 0}
        self._start()

    def stats(self) -> dict[str, int]:
        return {**self._stats, "subscribers": len(self._peers), "epoch": self._epoch}

    def close(self) -> None:
        super().close()
        self._store = None

    # --- control-plane hooks -------------------------------------------------------------------
    def _snapshot(self, version: int, state_dict: dict[str, torch.Tensor]) -> DeviceSnapshot:
        return device_snapshot(version, state_dict, self.bucket_bytes, self.device)

    def _started(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _stopped(self) -> None:
        if self._group is not None:
            self._group.close()

    def _take(self, snap: DeviceSnapshot) -> None:
        if snap.copied is not None:
            snap.copied.synchronize()
        self._newest = (snap, bucket_checksums(snap.buckets))
        self._stats["versions"] += 1

    def _hello(self, ident: bytes, peer: Peer, body: dict, joined: bool) -> None:
        if joined or self._lost_group(body):
            self._dirty = True

    def _left(self, ident: bytes, peer: Peer) -> None:
        self._dirty = True

    def _wait_ms(self) -> int:
        return IDLE_MS

    def _deliver(self) -> None:
        if self._dirty:
            self._form_group()
        if self._group is not None and self._lagging():
            self._send_newest()

    # --- membership ----------------------------------------------------------------------------
    def _lost_group(self, hello: dict) -> bool:
        """A member that was told to join the current group and is not in it (its collective failed)."""
        if self._group is None:
            return False  # none to lose; ``_dirty`` is already set if there are members
        return hello.get("epoch") != self._group.epoch and hello.get("seen", -1) >= self._group.epoch

    def _tell(self, ident: bytes, kind: bytes, body: dict) -> bool:
        """Send one control message; False if the member cannot take it (gone, or not reading)."""
        return self._send(ident, [kind, msgpack.packb(body)]) == "sent"

    def _drop(self, idents: list[bytes], why: str) -> None:
        for ident in idents:
            peer = self._peers.pop(ident, None)
            if peer is not None:
                log.warning("weights: subscriber %s dropped (%s)", peer.name, why)
                self._stats["dropped"] += 1

    def _form_group(self) -> None:
        """A new group of the current members under the next epoch; leaves ``_dirty`` set on failure."""
        if self._group is not None:
            self._group.close()
            self._group = None
        # Probe first: a member told to join a group that is then abandoned would wait out a timeout.
        self._drop([m for m in self._peers if not self._tell(m, b"ping", {})], "unreachable")
        members = list(self._peers)
        if not members:
            self._dirty = False
            return
        self._epoch += 1
        epoch, world, port = self._epoch, len(members) + 1, self._store.port
        told = {
            m: self._tell(m, b"epoch", {"epoch": epoch, "rank": r, "world": world, "store_port": port})
            for r, m in enumerate(members, 1)
        }
        if not all(told.values()):
            self._drop([m for m, ok in told.items() if not ok], "unreachable")
            return
        missing = self._wait_arrived(members, [arrived_key(epoch, r) for r in range(1, world)])
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

    # --- data ----------------------------------------------------------------------------------
    def _lagging(self) -> bool:
        if self._newest is None:
            return False
        version = self._newest[0].version
        return any(m in self._peers and self._peers[m].have < version for m in self._group_members)

    def _send_newest(self) -> None:
        snap, sums = self._newest
        group = self._group
        manifest = manifest_of(snap, group.epoch, sums)
        try:
            for kind, body in ((b"ping", {}), (b"version", manifest)):  # ping: nobody starts a doomed broadcast
                for m in self._group_members:
                    if not self._tell(m, kind, body):
                        raise ConnectionError(f"subscriber {getattr(self._peers.get(m), 'name', '?')} unreachable")
            for bucket in snap.buckets:
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
            if m in self._peers:
                self._peers[m].have = max(self._peers[m].have, snap.version)
        self._stats["sends"] += 1
        self._stats["sent_version"] = snap.version
