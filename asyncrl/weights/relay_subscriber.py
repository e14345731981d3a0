"""The relayed bus's subscriber (protocol in ``relay_bus``): receives, verifies and forwards in a
background thread, so relaying never waits for the generator to call ``poll``.

Concurrency: the thread owns all three sockets (control to the publisher, data from the upstream,
the relay ROUTER its downstreams attach to) and the ``Fanout``; it leaves the newest complete,
verified version in a one-slot mailbox that ``poll`` takes under a lock it holds only to swap the
slot, so ``poll`` never waits on the network. Memory: the version the caller holds, the one in the
slot (also kept for downstreams that join), and the one arriving.
"""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import msgpack
import torch
import zmq

from asyncrl.weights.base import BackgroundSubscriber, Mailbox, log, log_rejection
from asyncrl.weights.control_plane import bus_context, send_nonblocking
from asyncrl.weights.curve import curve_keys, make_client, make_server
from asyncrl.weights.delta import Held
from asyncrl.weights.relay_bus import HEARTBEAT_S, HWM, IDLE_MS, RELAY_BUCKET_BYTES, RETRY_MS
from asyncrl.weights.relay_fanout import (
    Fanout,
    Stream,
    attachment,
    open_stream,
    relay_endpoint,
    stream_of,
    verify_bucket,
    verify_whole,
)
from asyncrl.weights.wire import (
    WeightsRejected,
    WeightUpdate,
    as_buffer,
    flat_tensor,
    seal,
    sent_record,
    snapshot,
    tensor_views,
)


class RelayWeightSubscriber(BackgroundSubscriber):
    def __init__(self, address: str, subscriber_id: str, have: int = -1, secret: str | None = None) -> None:
        self.address, self.subscriber_id = address, subscriber_id
        self.latest_version, self.rejected = have, 0
        self._secret = secret
        self._mailbox = Mailbox()  # newest complete version not yet taken by poll
        self._closed = False
        ctx = bus_context()
        # Thread state from here on.
        self._have = have  # newest complete version received
        self._incoming: Stream | None = None
        self._control = self._dealer(address)
        self._data: zmq.Socket | None = None
        self.upstream: str | None = None  # endpoint the data comes from ("" = the publisher)
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.SNDHWM, HWM)
        self._router.setsockopt(zmq.LINGER, -1)  # see control_plane.bus_context
        bind = relay_endpoint(address)
        make_server(self._router, curve_keys(secret, bind))
        self._router.bind(bind)
        self.relay_address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        # No reference cycle through the fan-out (its sender is the socket's): a closed subscriber goes at once.
        self._fanout = Fanout(functools.partial(send_nonblocking, self._router, copy=False), self._full_of)
        self.held = Held()  # the version returned last, as tensors: what a delta applies to
        self.wants_full = False  # a delta did not apply: asked upstream for a full version
        self._made: Stream | None = None  # a full stream made from ``held`` for downstreams without a delta's base
        self._last_hello = 0.0
        self._thread = threading.Thread(target=self._run, name="weights-relay-sub", daemon=True)
        self._thread.start()

    # --- caller side ---------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._thread.join()  # bounded: every wait of the thread is at most IDLE_MS

    # --- background thread ---------------------------------------------------------------------
    def _dealer(self, endpoint: str) -> zmq.Socket:
        sock = bus_context().socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, HWM)
        sock.setsockopt(zmq.SNDHWM, 16)
        sock.setsockopt(zmq.LINGER, 200)  # lets "bye" leave after close
        make_client(sock, curve_keys(self._secret, endpoint))
        sock.connect(endpoint)
        return sock

    def _say(self, sock: zmq.Socket, kind: bytes, body: dict) -> None:
        try:
            sock.send_multipart([kind, msgpack.packb({"id": self.subscriber_id, **body})], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # unreachable for now; hello is repeated every HEARTBEAT_S

    def _run(self) -> None:
        torch.set_num_threads(1)
        try:
            while not self._closed:
                now = time.monotonic()
                if now - self._last_hello >= HEARTBEAT_S:
                    self._say(self._control, b"hello", {"have": self._have, "relay": self.relay_address})
                    if self._data is not None:  # an upstream that forgot this connection serves it again
                        self._say(self._data, b"attach", self._attach_fields())
                    self._last_hello = now
                poller = zmq.Poller()
                for sock in (self._control, self._data, self._router):
                    if sock is not None:
                        poller.register(sock, zmq.POLLIN)
                wait = RETRY_MS if self._fanout.lagging() else min(IDLE_MS, int(HEARTBEAT_S * 1000))
                events = dict(poller.poll(wait))
                try:
                    if self._control in events:
                        self._read_routes()
                    if self._data is not None and self._data in events:
                        self._read_data()
                    if self._router in events:
                        self._read_downstream()
                    self._fanout.pump()
                except Exception:  # noqa: BLE001 - the bus must outlive one bad message
                    log.exception("weights: relay subscriber %s thread error", self.subscriber_id)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._say(self._control, b"bye", {})
        if self._data is not None:
            self._say(self._data, b"bye", {})
            self._data.close()
        self._control.close()
        self._router.close()
        # The versions go with the thread (and the fan-out's reference back to this subscriber).
        self._fanout, self._incoming, self._made, self.held = Fanout(self._fanout.send), None, None, Held()
        if self.relay_address.startswith("ipc://"):
            Path(self.relay_address.removeprefix("ipc://")).unlink(missing_ok=True)

    def _read_routes(self) -> None:
        upstream = None
        for msg in _drain(self._control):
            if len(msg) == 2 and msg[0].bytes == b"route":
                try:
                    upstream = str(msgpack.unpackb(msg[1].bytes)["upstream"])
                except Exception:  # noqa: BLE001
                    log.debug("weights: ignoring malformed route")
        if upstream is not None and upstream != self.upstream:
            self._attach(upstream)

    def _attach(self, upstream: str) -> None:
        """Take the data from ``upstream`` from now on ("" = the publisher)."""
        if self._data is not None:
            self._say(self._data, b"bye", {})
            self._data.close()
        log.info("weights: %s takes versions from %s", self.subscriber_id, upstream or "the publisher")
        self.upstream = upstream
        self._data = self._dealer(upstream or self.address)
        self._say(self._data, b"attach", self._attach_fields())
        # A version half-received from the old upstream never completes: the new one starts afresh.
        if self._incoming is not None:
            self._fanout.fail(self._incoming)
            self._incoming = None

    def _read_downstream(self) -> None:
        for msg in _drain(self._router):
            if len(msg) != 3:
                continue
            ident, kind = msg[0].bytes, msg[1].bytes
            try:
                body = msgpack.unpackb(msg[2].bytes)
            except Exception:  # noqa: BLE001
                continue
            if kind == b"attach":
                if ident not in self._fanout.cursors:  # not its heartbeat repeats
                    log.debug("weights: %s relays to %s", self.subscriber_id, body.get("id"))
                self._fanout.attach(ident, *attachment(body))
            elif kind == b"bye":
                self._fanout.detach(ident)

    def _read_data(self) -> None:
        for msg in _drain(self._data):
            kind = msg[0].bytes if msg else b""
            if kind == b"manifest":
                self._on_manifest(msg)
            elif kind == b"bucket" and len(msg) == 3:
                self._on_bucket(msg)
            self._fanout.pump()  # forward each bucket at once, not after the whole batch

    def _reject(self, version: object, reason: str) -> None:
        self.rejected += 1
        log_rejection(self.subscriber_id, version, reason, self._have)

    def _on_manifest(self, msg: list) -> None:
        try:
            stream = open_stream(msg)
        except WeightsRejected as exc:
            self._reject("?", str(exc))
            return
        if self._incoming is not None:
            self._fanout.fail(self._incoming)  # superseded before it completed
            self._incoming = None
        if stream.version <= self._have:
            return  # already here (a new upstream resends what it has)
        self._incoming = stream
        self._fanout.offer(*((None, stream) if stream.base is not None else (stream,)))
        if not stream.buckets:
            self._complete(stream)

    def _on_bucket(self, msg: list) -> None:
        stream = self._incoming
        try:
            version, index = msgpack.unpackb(msg[1].bytes)
        except Exception:  # noqa: BLE001
            return
        if stream is None or version != stream.version or not isinstance(index, int):
            return  # a version this subscriber is not receiving (superseded, or already rejected)
        try:
            verify_bucket(stream, index, msg[2])
        except WeightsRejected as exc:
            self._fail(stream, str(exc))
            return
        if stream.complete:
            self._complete(stream)

    def _fail(self, stream: Stream, reason: str) -> None:
        self._reject(stream.version, reason)
        self._fanout.fail(stream)
        self._incoming = None
        if stream.base is not None:
            self._ask_full()  # the next delta would not apply either

    def _complete(self, stream: Stream) -> None:
        try:
            verify_whole(stream)
        except WeightsRejected as exc:
            self._fail(stream, str(exc))
            return
        entries = stream.manifest["tensors"]
        nbytes = sum(e["nbytes"] for e in entries)
        update = WeightUpdate(
            version=stream.version,
            tensors=tensor_views(entries, [flat_tensor(as_buffer(f)) for f in stream.buckets]),
            checksum=stream.manifest["checksum"],
            nbytes=nbytes,
            received_at=time.time(),
            published_at=float(stream.manifest.get("created_at", 0.0) or 0.0),
            sent=sent_record(stream.manifest, nbytes),
        )
        try:
            update = self.held.take(update, stream.manifest)  # a delta: the whole version it makes, verified
        except WeightsRejected as exc:
            self._fail(stream, str(exc))
            return
        self._incoming = None
        self._have = stream.version
        if stream.base is None:
            self._fanout.complete = stream
            if self.wants_full:
                update.sent["asked"], self.wants_full = True, False
        self._mailbox.put(update)

    def _attach_fields(self) -> dict:
        return {"have": self._have, "base": self.held.version, "full": self.wants_full}

    def _ask_full(self) -> None:
        """A delta did not apply here: ask the upstream for the newest version in full."""
        if not self.wants_full and self._data is not None:
            self.wants_full = True
            log.info("weights: %s asks for a full version (a delta did not apply)", self.subscriber_id)
            self._say(self._data, b"attach", self._attach_fields())

    def _full_of(self, version: int) -> Stream | None:
        """For a downstream without a delta's base: ``version`` as a full stream, made once from the held
        tensors (None until this relay holds it)."""
        if self.held.version != version:
            return None
        if self._made is None or self._made.version != version:
            reason = "a relay's downstream without the delta's base"
            frames = seal(snapshot(version, self.held.tensors, RELAY_BUCKET_BYTES), {"full_reason": reason})
            self._made = stream_of(frames)
        return self._made


def _drain(sock: zmq.Socket) -> list[list]:
    out = []
    while True:
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK, copy=False))
        except zmq.Again:
            return out
