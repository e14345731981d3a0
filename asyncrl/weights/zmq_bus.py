"""ZeroMQ weight bus: one ROUTER on the learner, one DEALER per generator (tcp:// or ipc://).

Control messages (subscriber -> publisher, after ZeroMQ's routing id)::

    [b"hello", msgpack({"id": str, "have": int})]   # on connect, and again after a silence
    [b"bye",   msgpack({"id": str})]                  # on close

Data (publisher -> subscriber): the version frames of ``asyncrl.weights.wire``.

Concurrency: the ROUTER is owned by one background thread; ``publish`` snapshots the state dict
in the caller's thread and leaves it in a one-slot mailbox (a newer version replaces an unsent
one) and wakes the thread through a pipe. The thread sends every new version to every known
subscriber with NOBLOCK under a small SNDHWM and ROUTER_MANDATORY: a full pipe (slow or stalled
subscriber) drops that send and retries the newest version every ``_RETRY_MS``; an unknown peer
(gone) is forgotten. Nothing the thread does can block on a subscriber, and since bucket frames
are zero-copy and shared by all sends, a version's memory exists once however many subscribers
hold it. A subscriber that says hello gets the newest version at once. ``close`` returns at once;
a version still being written to a slow subscriber finishes (or is dropped when that peer
leaves) in ZeroMQ's background thread (see ``bus_context`` for why the linger is infinite).

Subscribers re-send hello after ``rehello_s`` without traffic, so a restarted publisher at the
same address learns about them. A routing id (one per connection) that was already sent the newest
version is not sent it again on a repeated hello: on one connection ZeroMQ loses nothing, so that
copy is delivered or still in flight (a huge version can take longer than ``rehello_s``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack
import zmq

from asyncrl.weights.base import VerifyingSubscriber, Wakeup, WeightPublisher, check_publish, log
from asyncrl.weights.wire import BucketPool, Snapshot, seal, snapshot

if TYPE_CHECKING:
    import torch

# Messages queued per subscriber pipe: one being written plus the next; more would only hold
# memory for versions that a newer one supersedes anyway.
_HWM = 2
# How often the publisher retries the newest version to subscribers whose pipe was full.
_RETRY_MS = 20
# Housekeeping tick of the publisher thread when nothing is pending.
_IDLE_MS = 500

_CONTEXT: tuple[int, zmq.Context] | None = None  # (pid, context): a forked child makes its own


def bus_context() -> zmq.Context:
    """The bus's own ZeroMQ context, never terminated (nothing may block on it at exit).

    The ROUTER closes with infinite linger, which is only safe on a context nobody terminates:
    libzmq 4.3.5 aborts the process ("Resource temporarily unavailable (src/session_base.cpp:233)")
    when a socket closed with a finite linger still has a half-written multipart message to a peer
    (a slow generator mid-version) and that peer disconnects during the close. With infinite
    linger the half-sent version stays readable until it is written or the peer goes away.
    """
    global _CONTEXT
    if _CONTEXT is None or _CONTEXT[0] != os.getpid():
        _CONTEXT = (os.getpid(), zmq.Context())
    return _CONTEXT[1]


@dataclass
class _Peer:
    name: str
    sent: int  # newest version queued to this routing id (or the version it said it has)


class ZmqWeightPublisher(WeightPublisher):
    def __init__(self, address: str = "tcp://127.0.0.1:*", bucket_bytes: int = 64 << 20) -> None:
        self.bucket_bytes = bucket_bytes
        sock = bus_context().socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, _HWM)
        sock.setsockopt(zmq.LINGER, -1)  # see bus_context: a finite linger can abort the process
        sock.bind(address)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock  # from here on only the thread touches it
        self._lock = threading.Lock()
        self._pending: Snapshot | None = None
        self._pool = BucketPool()  # buckets of versions ZeroMQ has finished sending, for reuse
        self._last_version: int | None = None
        self._closing = False
        self._wakeup = Wakeup()  # publish -> thread: a version is pending
        # Thread state.
        self._peers: dict[bytes, _Peer] = {}
        self._newest: tuple[int, list, tuple] | None = None  # version, frames, pool release
        self._stats = {"versions": 0, "sends": 0, "deferred": 0}
        self._thread = threading.Thread(target=self._run, name="weights-publisher", daemon=True)
        self._thread.start()

    # --- caller side ---------------------------------------------------------------------------
    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        check_publish(version, self._last_version, self._closing)
        snap = snapshot(version, state_dict, self.bucket_bytes, self._pool)
        with self._lock:
            unsent, self._pending = self._pending, snap
            self._last_version = version
        if unsent is not None:
            self._pool.give(unsent.buckets)
        self._wakeup.set()

    def stats(self) -> dict[str, int]:
        return {**self._stats, "subscribers": len(self._peers), "buckets_reused": self._pool.reused}

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._wakeup.set()
        self._thread.join()  # bounded: every wait in the loop is a poll timeout of at most _IDLE_MS
        self._sock.close()  # returns at once; lingering sends end when written or the peer leaves
        self._wakeup.close()

    # --- background thread ---------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        while not self._closing:
            lagging = self._newest is not None and any(p.sent < self._newest[0] for p in self._peers.values())
            events = dict(poller.poll(_RETRY_MS if lagging else _IDLE_MS))
            try:
                if self._wakeup.fd in events:
                    self._wakeup.clear()
                    self._take_pending()
                if self._sock in events:
                    self._handle_control()
                self._send_lagging()
            except Exception:  # noqa: BLE001 - the bus must outlive one bad message or version
                log.exception("weights: publisher thread error")

    def _take_pending(self) -> None:
        with self._lock:
            snap, self._pending = self._pending, None
        if snap is None or self._closing:
            return
        frames = seal(snap)
        # Bucket frames wrap the snapshot's arrays without copying; every send shares them. Once
        # a newer version replaces them and ZeroMQ has written the last send, their trackers are
        # done and the arrays go back to the pool.
        buckets = [zmq.Frame(f, copy=False, track=True) for f in frames[2:]]
        if self._newest is not None:
            self._pool.give(*self._newest[2])
        trackers = [f.tracker for f in buckets]
        released = (snap.buckets, lambda: all(t.done for t in trackers))
        self._newest = (snap.version, [zmq.Frame(f) for f in frames[:2]] + buckets, released)
        self._stats["versions"] += 1

    def _handle_control(self) -> None:
        while True:
            try:
                msg = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(msg) != 3 or msg[1] not in (b"hello", b"bye"):
                log.debug("weights: ignoring control message of %d frames", len(msg))
                continue
            ident, kind = msg[0], msg[1]
            try:
                body = msgpack.unpackb(msg[2])
                name, have = str(body.get("id", "?")), int(body.get("have", -1))
            except Exception:  # noqa: BLE001
                log.debug("weights: ignoring malformed %s", kind)
                continue
            if kind == b"bye":
                self._peers.pop(ident, None)
                log.info("weights: subscriber %s left", name)
                continue
            peer = self._peers.get(ident)
            if peer is None:
                log.info("weights: subscriber %s joined (has version %d)", name, have)
                self._peers[ident] = _Peer(name, have)
            else:
                peer.sent = max(peer.sent, have)

    def _send_lagging(self) -> None:
        if self._newest is None:
            return
        version, frames, _ = self._newest
        for ident, peer in list(self._peers.items()):
            if peer.sent >= version:
                continue
            try:
                self._sock.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._stats["deferred"] += 1  # queue full: retried next tick, newest version only
                continue
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                log.debug("weights: subscriber %s unreachable, forgotten", peer.name)
                del self._peers[ident]
                continue
            peer.sent = version
            self._stats["sends"] += 1


class ZmqWeightSubscriber(VerifyingSubscriber):
    def __init__(self, address: str, subscriber_id: str, have: int = -1, rehello_s: float = 5.0) -> None:
        super().__init__(subscriber_id, have)
        self.address = address
        self.rehello_s = rehello_s
        self._sock = bus_context().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.RCVHWM, _HWM)
        self._sock.setsockopt(zmq.SNDHWM, 16)
        self._sock.setsockopt(zmq.LINGER, 200)  # lets "bye" leave after close
        # No ROUTING_ID: the ROUTER names every connection afresh, so a reconnect is a new peer
        # (whatever was queued to the old connection is gone) and gets the newest version again.
        self._sock.connect(address)
        self._closed = False
        self._hello()

    def _control(self, kind: bytes, body: dict) -> None:
        try:
            self._sock.send_multipart([kind, msgpack.packb(body)], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # publisher unreachable for now; hello is repeated after rehello_s
        self._last_contact = time.monotonic()

    def _hello(self) -> None:
        self._control(b"hello", {"id": self.subscriber_id, "have": self.latest_version})

    def _drain(self, out: list[Sequence]) -> None:
        while True:
            try:
                out.append(self._sock.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                return

    def _receive(self, timeout_ms: int) -> list[Sequence]:
        if self._closed:
            raise RuntimeError("poll on a closed weight subscriber")
        messages: list[Sequence] = []
        self._drain(messages)
        if not messages and timeout_ms > 0 and self._sock.poll(timeout_ms, zmq.POLLIN):
            self._drain(messages)
        now = time.monotonic()
        if messages:
            self._last_contact = now
        elif now - self._last_contact > self.rehello_s:
            self._hello()
        return messages

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._control(b"bye", {"id": self.subscriber_id})
        self._sock.close()
