"""The pieces of the relayed ZeroMQ bus (``relay_bus``) that the publisher and every relay share:
a version as a stream of bucket messages, the per-bucket check, and the fan-out to downstreams.

A version on a data connection (upstream ROUTER -> downstream DEALER) is ``m + 1`` messages::

    [b"manifest", WIRE_HEADER, manifest_msgpack]        # wire's manifest, unchanged
    [b"bucket", msgpack([version, index]), bucket]       # index = 0 .. m-1, in order

Concurrency: a ``Fanout`` belongs to the one thread that owns its ROUTER; ``pump`` never blocks (a
full pipe is retried on the next pump), so a stalled downstream delays no other.
"""

from __future__ import annotations

import dataclasses
import socket
import uuid
from collections.abc import Callable
from pathlib import Path

import msgpack
import xxhash
import zmq

from asyncrl.weights.base import log
from asyncrl.weights.wire import (
    WIRE_HEADER,
    WeightsRejected,
    as_buffer,
    check_entries,
    combine_digests,
    peek_version,
    tensor_digests,
    tensor_view,
)

Sent = str  # control_plane.Sent: "sent", "full" or "gone"


@dataclasses.dataclass(eq=False)
class Stream:
    """One version as its buckets arrive; every bucket present has verified."""

    version: int
    manifest: dict
    head: list  # frames of the manifest message
    buckets: list  # zmq.Frame per bucket, None until it arrives and verifies
    digests: list  # per bucket: its tensors' digests (for the whole checksum)
    failed: bool = False  # rejected or abandoned incomplete: nobody may send more of it

    @property
    def complete(self) -> bool:
        return all(b is not None for b in self.buckets)

    @property
    def base(self) -> int | None:
        """A delta's base version (``delta``); None: a full version."""
        delta = self.manifest.get("delta")
        return delta.get("base") if isinstance(delta, dict) else None


def attachment(body: dict) -> tuple[str, int, int, bool]:
    """An attach message's (id, have, base, full): who, the newest version it holds, the one it holds as
    tensors (a delta's base; -1: none) and whether it asks for a full version (a delta did not apply)."""
    return str(body.get("id", "?")), int(body.get("have", -1)), int(body.get("base", -1)), bool(body.get("full"))


def stream_of(frames: list) -> Stream:
    """A stream of a sealed version (``wire.seal``'s frames), every bucket here: what a publisher offers."""
    buckets = [zmq.Frame(f, copy=False, track=True) for f in frames[2:]]
    manifest = msgpack.unpackb(frames[1])
    head = [zmq.Frame(b"manifest"), zmq.Frame(frames[0]), zmq.Frame(frames[1])]
    return Stream(manifest["version"], manifest, head, buckets, [None] * len(buckets))


def manifest_message(manifest_bytes: bytes) -> list:
    return [b"manifest", WIRE_HEADER, manifest_bytes]


def bucket_message(version: int, index: int, frame) -> list:
    return [b"bucket", msgpack.packb([version, index]), frame]


def open_stream(frames: list) -> Stream:
    """A stream from a received manifest message; raises ``WeightsRejected`` (checks what ``decode``
    checks before the bytes: header, schema, tensor extents against the announced bucket sizes)."""
    if len(frames) != 3:
        raise WeightsRejected(f"manifest message has {len(frames)} frames")
    version, manifest = peek_version(frames[1:])
    metas = manifest["buckets"]
    if not all(isinstance(b, dict) and isinstance(b.get("nbytes"), int) for b in metas):
        raise WeightsRejected("manifest buckets are not maps with nbytes")
    check_entries(manifest["tensors"], [b["nbytes"] for b in metas])
    manifest["tensors"] = sorted(manifest["tensors"], key=lambda e: e["name"])
    head = [zmq.Frame(b"manifest"), zmq.Frame(WIRE_HEADER), zmq.Frame(bytes(as_buffer(frames[2])))]
    return Stream(version, manifest, head, [None] * len(metas), [None] * len(metas))


def verify_bucket(stream: Stream, index: int, frame) -> None:
    """Check one arrived bucket against the manifest and keep it; raises ``WeightsRejected``."""
    if not 0 <= index < len(stream.buckets):
        raise WeightsRejected(f"bucket index {index} out of range")
    buf = as_buffer(frame)
    meta = stream.manifest["buckets"][index]
    if buf.nbytes != meta["nbytes"]:
        raise WeightsRejected(f"bucket {index}: {buf.nbytes} bytes, manifest says {meta['nbytes']}")
    entries = [e for e in stream.manifest["tensors"] if e["nbytes"] and e["bucket"] == index]
    digests = tensor_digests([tensor_view(e, {index: buf}) for e in entries])
    h = xxhash.xxh3_128()
    for d in digests:
        h.update(d)
    if h.hexdigest() != meta.get("checksum"):
        raise WeightsRejected(f"bucket {index}: checksum mismatch")
    stream.buckets[index] = frame
    stream.digests[index] = dict(zip((e["name"] for e in entries), digests, strict=True))


def verify_whole(stream: Stream) -> None:
    """The state checksum of a complete stream, from the bucket checks' digests."""
    found: dict[str, bytes] = {}
    for d in stream.digests:
        found.update(d)
    empty = xxhash.xxh3_128_digest(b"")
    items = ((e["name"], e["dtype"], e["shape"], found.get(e["name"], empty)) for e in stream.manifest["tensors"])
    if combine_digests(items) != stream.manifest["checksum"]:
        raise WeightsRejected("state dict checksum mismatch")


@dataclasses.dataclass(eq=False)
class Cursor:
    """What one downstream has been sent."""

    name: str
    have: int  # newest version it holds or was sent in full
    base: int = -1  # the version it holds as tensors, which a delta applies to (-1: none)
    stream: Stream | None = None  # the version being sent to it
    next: int = -1  # next bucket to send; -1: the manifest


class Fanout:
    """Sends the newest version to every downstream, each bucket as soon as it is here.

    A downstream gets the version it was started on to the end (so each send completes however
    fast versions come), then the newest one, unless that stream failed or was abandoned upstream.
    The newest version may be a full stream, a delta (``delta``) against the version before, or both:
    a downstream that holds the delta's base gets the delta, any other the full stream, which
    ``full_of(version)`` makes when there is none yet (a relay that received the delta makes it from the
    version the delta gave it; None: not yet, asked again at the next pump).
    """

    def __init__(self, send: Callable[[bytes, list], Sent], full_of: Callable[[int], Stream | None] | None = None):
        self.send = send
        self.full_of = full_of
        self.cursors: dict[bytes, Cursor] = {}
        self.current: Stream | None = None  # newest full version, arriving or complete
        self.delta: Stream | None = None  # newest version as a delta, arriving or complete
        self.complete: Stream | None = None  # newest complete full version
        self.sends = 0

    @property
    def newest(self) -> int:
        return max((s.version for s in (self.current, self.delta) if s is not None), default=-1)

    def attach(self, ident: bytes, name: str, have: int, base: int = -1, full: bool = False) -> None:
        """A downstream attaches, or repeats its attach (every heartbeat): a known one keeps its
        cursor (a send in progress goes on), an unknown one, new or forgotten, gets a fresh one. One that
        asks for a ``full`` version (a delta did not apply there) is sent the newest again, in full."""
        cursor = self.cursors.get(ident)
        if cursor is None:
            self.cursors[ident] = Cursor(name, have, base)
        elif full and cursor.base != -1:
            cursor.have, cursor.base, cursor.stream = have, -1, None

    def detach(self, ident: bytes) -> None:
        self.cursors.pop(ident, None)

    def offer(self, stream: Stream | None, delta: Stream | None = None) -> None:
        """``stream`` (full) and ``delta`` (or either) are the newest version now (buckets may still be arriving)."""
        for old in (self.current, self.delta):
            if old is not None and not old.complete:
                old.failed = True  # abandoned: its downstreams restart on the new one
        self.current, self.delta = stream, delta
        if stream is not None and stream.complete:
            self.complete = stream

    def fail(self, stream: Stream) -> None:
        stream.failed = True
        if self.current is stream:
            self.current = self.complete
        if self.delta is stream:
            self.delta = None

    def lagging(self) -> bool:
        newest = self.newest
        return newest >= 0 and any(c.have < newest or c.stream is not None for c in self.cursors.values())

    def pump(self) -> None:
        for ident, cursor in list(self.cursors.items()):
            if self._pump_one(ident, cursor) == "gone":
                log.info("weights: downstream %s unreachable, forgotten", cursor.name)
                del self.cursors[ident]

    def _next_stream(self, c: Cursor) -> Stream | None:
        """What ``c`` is sent next: the newest version, as a delta if it holds the base; None: nothing now."""
        newest = self.newest
        if newest <= c.have:
            return None
        if self.delta is not None and self.delta.version == newest and c.base == self.delta.base:
            return self.delta
        if self.current is not None and self.current.version == newest:
            return self.current
        return self.full_of(newest) if self.full_of is not None else None

    def _pump_one(self, ident: bytes, c: Cursor) -> Sent:
        if c.stream is not None and c.stream.failed:
            c.stream = None
        if c.stream is None:
            c.stream, c.next = self._next_stream(c), -1
            if c.stream is None:
                return "sent"
        s = c.stream
        while c.next < len(s.buckets):
            if c.next == -1:
                frames = s.head
            elif s.buckets[c.next] is None:
                return "sent"  # not here yet: the next pump after it arrives goes on
            else:
                frames = bucket_message(s.version, c.next, s.buckets[c.next])
            sent = self.send(ident, frames)
            if sent != "sent":
                return sent
            c.next += 1
        c.have, c.base, c.stream = s.version, s.version, None
        self.sends += 1
        return "sent"


def relay_endpoint(upstream: str) -> str:
    """What a relay binds: tcp on the local address that reaches ``upstream`` (any free port), or an
    ipc socket in the same directory as an ipc upstream."""
    if upstream.startswith("ipc://"):
        directory = Path(upstream.removeprefix("ipc://")).parent
        for _ in range(100):  # binding an existing ipc path would steal it from its owner
            path = directory / f"r{uuid.uuid4().hex[:7]}.sock"  # no longer than "weights.sock"+1
            if not path.exists():
                return f"ipc://{path}"
        raise FileExistsError(f"no free relay socket name in {directory}")
    host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))  # UDP: no packet is sent; the kernel picks the route's source address
        local = s.getsockname()[0]
    return f"tcp://[{local}]:*" if family == socket.AF_INET6 else f"tcp://{local}:*"
