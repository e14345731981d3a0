"""Relayed ZeroMQ weight bus (``weights.relay``): subscribers pass each version's buckets on to one
another along a chain, so the publisher sends a version about once whatever the fleet size.

Protocol. Every subscriber binds a relay endpoint of its own (``relay_fanout.relay_endpoint``: tcp
on the local address that reaches the publisher, or ipc next to the publisher's socket) and holds
two connections out:

- control, to the publisher (the control plane of ``control_plane``)::

      subscriber -> publisher  [b"hello", {"id": str, "have": int, "relay": endpoint}]  # every HEARTBEAT_S
                               [b"bye",   {"id": str}]
      publisher -> subscriber  [b"route", {"upstream": endpoint}]   # reply to every hello; "" = the publisher

- data, to its upstream (the publisher itself or another subscriber's relay endpoint)::

      downstream -> upstream   [b"attach", {"id": str, "have": int}]   # on connect, every HEARTBEAT_S
                               [b"bye",    {"id": str}]
      upstream -> downstream   the stream of ``relay_fanout``: a manifest, then one message per bucket

  The repeated attach keeps a downstream served when its upstream forgot the connection (a send
  found its routing id gone: a dropped and remade connection, which the upstream sees as new):
  the upstream keeps the cursor of a known one and opens a fresh one for an unknown one.

Topology: the publisher orders the live subscribers by when they (re)joined and chains them
(``chain_routes``): the first takes its data from the publisher, each next one from the one before.
A subscriber silent for ``DEAD_S`` (dead, or stopped: its heartbeat comes from a thread that a
SIGSTOP stops too) leaves the chain, and the one behind it is routed past it at its next hello; a
returning one says hello again and joins at the end. So a relay is bypassed within about
``DEAD_S + HEARTBEAT_S``. A live but slow one (its hellos report the newest version it completed)
that is still without a version its upstream completed ``SLOW_S`` ago moves to the end of the chain,
where it holds nobody up. A joiner is served at once by its upstream, which sends the newest
version it has, complete or still arriving.

Verification: every hop checks each bucket (size, then its checksum over its tensors' digests)
before it forwards or keeps it, and the whole ``state_dict_checksum`` once every bucket is in; a
subscriber's ``poll`` only ever sees complete versions that passed both. A bad bucket fails its
version at that hop (counted in ``rejected``, never forwarded); the hops below never complete it
and keep their previous version. A relay forwards each bucket as soon as it verified (pipelined):
with b buckets and n chained subscribers the last one has the version after about b + n - 1
bucket times, against b * n for direct fan-out (hence ``RELAY_BUCKET_BYTES``). The publisher
writes each version once; every subscriber receives it once and writes it once more.

Authentication: with a secret, the publisher's ROUTER and every relay endpoint over tcp are CURVE
servers with the run's server keys and every connection a CURVE client (``curve``): a subscriber
can only be fed by a holder of the secret, relay or publisher.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING

import msgpack

from asyncrl.weights.base import log
from asyncrl.weights.control_plane import Peer, RouterPublisher, send_nonblocking
from asyncrl.weights.delta import DeltaPolicy, Deltas
from asyncrl.weights.relay_fanout import Fanout, attachment, stream_of
from asyncrl.weights.wire import BucketPool, Snapshot, seal, snapshot

if TYPE_CHECKING:
    import torch

# Messages queued per pipe: a few buckets in flight keep a chain's pipes busy between pumps.
HWM = 4
# A subscriber says hello this often; the publisher drops one silent for DEAD_S from the chain. Six
# heartbeats: a subscriber starved of CPU for a moment (2 cores, 8 processes) is not dropped.
HEARTBEAT_S = 0.5
DEAD_S = 3.0
# A relay still without the version its upstream has had for this long is slow (a starved host, a
# thin link, a stuck process that still says hello): it moves to the end of the chain. In a healthy
# pipelined chain a hop is a bucket time behind its upstream (milliseconds to a second).
SLOW_S = 3.0
# The largest bucket of a relayed stream (a smaller weights.bucket_mb is kept). A chain is a
# pipeline as deep as a version has buckets: the last of n subscribers has it after about
# (b + n - 1) bucket times against b for one, so a 200 MB model in 64 MiB buckets (b = 4) would cost
# 2.75 transfers over 8 hops, and in 8 MiB ones (b = 27) 1.26. Each bucket is one message: below
# about 1 MiB the per-message costs would start to show.
RELAY_BUCKET_BYTES = 8 << 20
# Publisher thread tick: a pipe that was full is retried this often, silent peers noticed this late.
RETRY_MS = 10
IDLE_MS = 200


@dataclasses.dataclass
class Member:
    """A subscriber in the chain, as the publisher knows it."""

    name: str
    relay: str  # its endpoint, "" if it does not relay
    joined: float  # monotonic time it (re)joined: the chain order
    seen: float  # monotonic time of its last hello
    have: int = -1  # the newest complete version it reported
    behind_since: float | None = None  # monotonic time it fell behind its upstream (None: it is not)


def chain_routes(members: list[Member]) -> list[str]:
    """Each member's upstream, in ``members``' order: the first is fed by the publisher (""), every
    next one by the nearest relay before it. The invariant: every member has exactly one upstream,
    which is the publisher or a live member earlier in the chain, so there is no cycle."""
    routes, last = [], ""
    for m in members:
        routes.append(last)
        if m.relay:
            last = m.relay
    return routes


class RelayWeightPublisher(RouterPublisher[Snapshot]):
    def __init__(
        self,
        address: str = "tcp://127.0.0.1:*",
        bucket_bytes: int = 64 << 20,
        secret: str | None = None,
        deltas: DeltaPolicy | None = None,
    ) -> None:
        super().__init__(address, "weights-relay-publisher", sndhwm=HWM, secret=secret)
        self.bucket_bytes = min(bucket_bytes, RELAY_BUCKET_BYTES)
        self._deltas = Deltas(deltas, self.bucket_bytes) if deltas is not None else None
        self._pool = BucketPool()
        # The sender is the socket's, not a bound method: a publisher in no reference cycle is freed,
        # with the versions it holds, as soon as its owner drops it (not at the next full collection).
        self._fanout = Fanout(functools.partial(send_nonblocking, self._sock, copy=False))
        self._members: dict[bytes, Member] = {}  # thread state: control connections in the chain
        self._released = None  # buckets of the newest version, for the pool once replaced
        self._stats = {"versions": 0, "dropped": 0, "demoted": 0}
        self._newest_at: tuple[int, float] | None = None  # (newest version, when the thread took it)
        self._rerouted_at = 0.0  # monotonic time of the last demotion
        self._start()

    def stats(self) -> dict[str, int]:
        return {
            **self._stats,
            "subscribers": len(self._members),
            "sends": self._fanout.sends,
            "buckets_reused": self._pool.reused,
        }

    def _routes(self) -> dict[bytes, str]:
        """Thread: each member's upstream ("" = the publisher)."""
        order = sorted(self._members.items(), key=lambda kv: kv[1].joined)
        return dict(zip((i for i, _ in order), chain_routes([m for _, m in order]), strict=True))

    # --- control-plane hooks -------------------------------------------------------------------
    def _snapshot(self, version: int, state_dict: dict[str, torch.Tensor]) -> Snapshot:
        return snapshot(version, state_dict, self.bucket_bytes, self._pool)

    def _discard(self, snap: Snapshot) -> None:
        self._pool.give(snap.buckets)

    def _take(self, snap: Snapshot) -> None:
        # With deltas, the version before stays until its delta is made: its buckets go to the pool after.
        frames, delta = self._deltas.seal(snap) if self._deltas is not None else (seal(snap), None)
        stream = stream_of(frames)
        if self._released is not None:
            self._pool.give(*self._released)
        trackers = [f.tracker for f in stream.buckets]
        self._released = (snap.buckets, lambda: all(t.done for t in trackers))
        self._fanout.offer(stream, stream_of(delta[1]) if delta is not None else None)
        self._newest_at = (snap.version, time.monotonic())
        self._stats["versions"] += 1

    def _hello(self, ident: bytes, peer: Peer, body: dict, joined: bool) -> None:
        now = time.monotonic()
        member = self._members.get(ident)
        if member is None:
            member = self._members[ident] = Member(peer.name, str(body.get("relay") or ""), now, now)
        member.seen = now
        have = int(body.get("have", -1))
        member.have = max(member.have, have)
        self._send(ident, [b"route", msgpack.packb({"upstream": self._routes()[ident]})])

    def _left(self, ident: bytes, peer: Peer) -> None:
        self._members.pop(ident, None)

    def _other(self, ident: bytes, kind: bytes, body: dict) -> None:
        if kind == b"attach":
            self._fanout.attach(ident, *attachment(body))
        elif kind == b"bye":
            self._fanout.detach(ident)
        else:
            super()._other(ident, kind, body)

    def _wait_ms(self) -> int:
        return RETRY_MS if self._fanout.lagging() else IDLE_MS

    def _stopped(self) -> None:
        self._fanout = Fanout(self._fanout.send)  # the versions go now, not when the publisher does
        self._released, self._pool = None, BucketPool()
        if self._deltas is not None:
            self._deltas.base = None

    def _deliver(self) -> None:
        now = time.monotonic()
        for ident, m in list(self._members.items()):
            if now - m.seen > DEAD_S:
                log.info("weights: subscriber %s silent for %.1fs, routed around", m.name, now - m.seen)
                del self._members[ident]
                self._peers.pop(ident, None)  # its next hello re-joins it, at the end of the chain
                self._stats["dropped"] += 1
                self._rerouted_at = now
        self._demote_slow(now)
        self._fanout.pump()

    def _demote_slow(self, now: float) -> None:
        """Move a relay that lags its own upstream by more than ``SLOW_S`` to the end of the chain (at
        most one per tick), so the members behind it take their data from its upstream instead."""
        if self._newest_at is None:
            return
        order = sorted(self._members.values(), key=lambda m: m.joined)
        version = self._newest_at[0]  # the publisher heads the chain
        for m in order[:-1]:  # the last member holds nobody up
            if m.have >= version:
                m.behind_since = None
            else:
                # behind since its upstream first had a newer version than it (new publishes do not
                # reset that), or since the chain last changed (a member just routed to a new upstream
                # gets SLOW_S to catch up from it: no cascade)
                m.behind_since = m.behind_since or now
                behind = now - max(m.behind_since, self._rerouted_at)
                if behind > SLOW_S:
                    log.info("weights: %s is %.1fs behind its upstream, moved to the chain's end", m.name, behind)
                    m.joined = self._rerouted_at = now
                    m.behind_since = None
                    self._stats["demoted"] += 1
                    return
            if m.relay:
                version = m.have
