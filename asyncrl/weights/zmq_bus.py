"""ZeroMQ weight bus, direct fan-out (``weights.relay = false``): the control plane of
``control_plane`` (tcp:// or ipc://), with the version frames of ``asyncrl.weights.wire`` as data,
publisher -> subscriber, on the same connection. The publisher writes every version once per
subscriber; ``relay_bus`` (the default) has the subscribers relay it instead. Over tcp with the
run secret both ends are CURVE-authenticated and encrypted (``curve``).

The publisher thread sends every new version to every known subscriber with NOBLOCK under a small
SNDHWM and ROUTER_MANDATORY: a full pipe (slow or stalled subscriber) drops that send and retries
the newest version every ``_RETRY_MS``; an unknown peer (gone) is forgotten. Nothing the thread does
can block on a subscriber, and since bucket frames are zero-copy and shared by all sends, a
version's memory exists once however many subscribers hold it. A subscriber that says hello gets
the newest version at once. ``close`` returns at once; a version still being written to a slow
subscriber finishes (or is dropped when that peer leaves) in ZeroMQ's background thread.

A routing id (one per connection) that was already sent the newest version is not sent it again
on a repeated hello: on one connection ZeroMQ loses nothing, so that copy is delivered or still in
flight (a huge version can take longer than ``rehello_s``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import zmq

from asyncrl.weights.base import VerifyingSubscriber, log
from asyncrl.weights.control_plane import ControlClient, Peer, RouterPublisher
from asyncrl.weights.delta import DeltaPolicy, Deltas
from asyncrl.weights.wire import BucketPool, Snapshot, seal, snapshot

if TYPE_CHECKING:
    import numpy as np
    import torch

# Messages queued per subscriber pipe: one being written plus the next; more would only hold
# memory for versions that a newer one supersedes anyway.
_HWM = 2
# How often the publisher retries the newest version to subscribers whose pipe was full.
_RETRY_MS = 20
# Housekeeping tick of the publisher thread when nothing is pending.
_IDLE_MS = 500


class ZmqWeightPublisher(RouterPublisher[Snapshot]):
    def __init__(
        self,
        address: str = "tcp://127.0.0.1:*",
        bucket_bytes: int = 64 << 20,
        secret: str | None = None,
        deltas: DeltaPolicy | None = None,
    ) -> None:
        super().__init__(address, "weights-publisher", sndhwm=_HWM, secret=secret)
        self.bucket_bytes = bucket_bytes
        self._pool = BucketPool()  # buckets of versions ZeroMQ has finished sending, for reuse
        # Thread state: the newest version, its frames, and its buckets' release for the pool.
        self._newest: tuple[int, list, tuple[list[np.ndarray], Callable[[], bool]]] | None = None
        # With deltas: the newest version's snapshot (the next delta's base) and checksum, and its delta
        # (the frames, and the version it applies to) when it went as one.
        self._deltas = Deltas(deltas, bucket_bytes) if deltas is not None else None
        self._delta: tuple[int, list] | None = None
        self._stats = {"versions": 0, "sends": 0, "deferred": 0, "delta_sends": 0, "full_sends": 0}
        self._start()

    def stats(self) -> dict[str, int]:
        return {**self._stats, "subscribers": len(self._peers), "buckets_reused": self._pool.reused}

    def _snapshot(self, version: int, state_dict: dict[str, torch.Tensor]) -> Snapshot:
        return snapshot(version, state_dict, self.bucket_bytes, self._pool)

    def _discard(self, snap: Snapshot) -> None:
        self._pool.give(snap.buckets)

    def _take(self, snap: Snapshot) -> None:
        frames = self._seal(snap)
        # Bucket frames wrap the snapshot's arrays without copying; every send shares them. Once
        # a newer version replaces them and ZeroMQ has written the last send, their trackers are
        # done and the arrays go back to the pool.
        buckets = [zmq.Frame(f, copy=False, track=True) for f in frames[2:]]
        if self._newest is not None and self._deltas is None:
            self._pool.give(*self._newest[2])
        trackers = [f.tracker for f in buckets]
        released = (snap.buckets, lambda: all(t.done for t in trackers))
        self._newest = (snap.version, [zmq.Frame(f) for f in frames[:2]] + buckets, released)
        self._stats["versions"] += 1

    def _seal(self, snap: Snapshot) -> list:
        """``snap``'s full frames, and with deltas, its delta against the version before (``_delta``)."""
        if self._deltas is None:
            return seal(snap)
        frames, self._delta = self._deltas.seal(snap)
        if self._newest is not None:
            self._pool.give(*self._newest[2])  # the base's buckets: no delta needs them any more
        return frames

    def _stopped(self) -> None:
        self._newest, self._pool = None, BucketPool()  # the versions go now, not when the publisher does
        self._delta = None
        if self._deltas is not None:
            self._deltas.base = None

    def _hello(self, ident: bytes, peer: Peer, body: dict, joined: bool) -> None:
        if body.get("full"):  # a delta did not apply there: the newest again, in full
            peer.have, peer.base = int(body.get("have", -1)), -1
        elif joined:  # what it holds as tensors, which a delta applies to (none: it gets full versions)
            peer.base = int(body.get("base", -1))
        peer.have = max(peer.have, int(body.get("have", -1)))

    def _wait_ms(self) -> int:
        lagging = self._newest is not None and any(p.have < self._newest[0] for p in self._peers.values())
        return _RETRY_MS if lagging else _IDLE_MS

    def _deliver(self) -> None:
        if self._newest is None:
            return
        version, full, _ = self._newest
        for ident, peer in list(self._peers.items()):
            if peer.have >= version:
                continue
            delta = self._delta is not None and peer.base == self._delta[0]
            sent = self._send(ident, self._delta[1] if delta else full, copy=False)
            if sent == "full":
                self._stats["deferred"] += 1  # queue full: retried next tick, newest version only
            elif sent == "gone":
                log.debug("weights: subscriber %s unreachable, forgotten", peer.name)
                del self._peers[ident]
            else:
                peer.have = peer.base = version
                self._stats["sends"] += 1
                self._stats["delta_sends" if delta else "full_sends"] += 1


class ZmqWeightSubscriber(VerifyingSubscriber):
    def __init__(
        self, address: str, subscriber_id: str, have: int = -1, rehello_s: float = 5.0, secret: str | None = None
    ) -> None:
        super().__init__(subscriber_id, have)
        self.address = address
        self._client = ControlClient(address, subscriber_id, self._fields, rehello_s, rcvhwm=_HWM, secret=secret)
        self._closed = False
        self._client.hello()

    def _fields(self) -> dict:
        return {"have": self.latest_version, "base": self.held.version, "full": self.wants_full}

    def _want_full(self) -> None:
        self._client.hello()

    def _receive(self, timeout_ms: int) -> list[Sequence]:
        if self._closed:
            raise RuntimeError("poll on a closed weight subscriber")
        return self._client.receive(timeout_ms, copy=False)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()
            del self._client  # its hello fields read this subscriber: no cycle left to outlive it
