"""The control plane that the socket transports share: a ROUTER on the publisher, a DEALER per
subscriber, msgpack bodies (never pickle).

Subscriber -> publisher, after ZeroMQ's routing id::

    [b"hello", msgpack({"id": str, "have": int, ...})]   # on connect, and again after a silence
    [b"bye",   msgpack({"id": str})]                      # on close
    [kind,     msgpack({...})]                            # a transport's own (``_other``)

``have`` is the newest version the subscriber holds; a transport may add fields (the collective
bus adds its group epoch, the relayed bus its relay endpoint) and kinds of its own (the relayed
bus's ``attach``, handed to ``_other``). What the publisher sends back is the transport's
(``zmq_bus``: version frames; ``relay_bus``: routes on control connections, bucket streams on
data connections; ``collective_bus``: epoch assignments and manifests).

With the run secret, a tcp ROUTER is a CURVE server and every DEALER a CURVE client of the keys
derived from it (``curve``): a connection without the secret never completes its handshake, so
none of its messages reach the thread and nothing is sent to it.

Publisher concurrency: ``RouterPublisher`` owns the ROUTER from one background thread.
``publish`` snapshots the state dict in the caller's thread (the transport's ``_snapshot``), leaves
it in a one-slot mailbox (a newer version replaces an unsent one, which the transport gets back in
``_discard``) and wakes the thread through a pipe. The thread hands the newest snapshot to
``_take``, keeps the peer table from hellos and byes (telling the transport through ``_hello`` and
``_left``) and calls ``_deliver`` after every wake-up; it sleeps at most ``_wait_ms()``, so every
hook runs on that one thread and may block it only as long as the transport allows.

Subscriber side: ``ControlClient`` says hello on ``hello()`` and again after ``rehello_s`` without
traffic, so a restarted publisher at the same address learns about it, and bye on ``close``. It
belongs to the one thread that calls ``receive``.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, Literal, TypeVar

import msgpack
import zmq

from asyncrl.weights.base import WeightPublisher, check_publish, log
from asyncrl.weights.curve import curve_keys, make_client, make_server

if TYPE_CHECKING:
    import torch

# A send to one peer: queued, its pipe is full (retry later), or its connection is gone.
Sent = Literal["sent", "full", "gone"]
Snap = TypeVar("Snap")

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


def send_nonblocking(sock: zmq.Socket, ident: bytes, frames: list, copy: bool = True) -> Sent:
    """Queue ``frames`` to the peer ``ident`` of a ROUTER (with ROUTER_MANDATORY) without blocking."""
    try:
        sock.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=copy)
    except zmq.Again:
        return "full"
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EHOSTUNREACH:
            raise
        return "gone"
    return "sent"


class Wakeup:
    """A self-pipe: any thread ``set``s it, the one thread that polls ``fd`` (with ZeroMQ's poller,
    beside its socket) ``clear``s it. Never blocks: a full pipe means a wake-up is already due."""

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)

    def set(self) -> None:
        try:
            os.write(self._write_fd, b"\0")
        except BlockingIOError:
            pass

    def clear(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._write_fd)


@dataclasses.dataclass
class Peer:
    """One subscriber connection (a routing id), as the publisher thread knows it."""

    name: str
    have: int  # newest version it holds or has been sent, as far as the publisher knows
    base: int = -1  # the version it holds as tensors, which a delta applies to (-1: none; ``delta``)


class RouterPublisher(WeightPublisher, Generic[Snap]):
    """The publisher's control plane; a transport subclasses it and fills in the hooks."""

    def __init__(self, address: str, thread_name: str, sndhwm: int | None = None, secret: str | None = None) -> None:
        sock = bus_context().socket(zmq.ROUTER)
        make_server(sock, curve_keys(secret, address))
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if sndhwm is not None:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.LINGER, -1)  # see bus_context: a finite linger can abort the process
        sock.bind(address)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock  # from here on only the thread touches it
        self._lock = threading.Lock()
        self._pending: Snap | None = None
        self._last_version: int | None = None
        self._closing = False
        self._wakeup = Wakeup()  # publish -> thread: a version is pending
        self._peers: dict[bytes, Peer] = {}  # thread state
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _start(self) -> None:
        """Start the thread; a subclass calls it last in its ``__init__``."""
        self._thread.start()

    # --- transport hooks ---------------------------------------------------------------------------
    @abc.abstractmethod
    def _snapshot(self, version: int, state_dict: dict[str, torch.Tensor]) -> Snap:
        """Caller's thread: a private copy of ``state_dict`` as ``version``."""

    def _discard(self, snap: Snap) -> None:  # noqa: B027 - optional hook
        """Caller's thread: ``snap`` was replaced by a newer version before the thread took it."""

    @abc.abstractmethod
    def _take(self, snap: Snap) -> None:
        """Thread: ``snap`` is the newest version now."""

    def _hello(self, ident: bytes, peer: Peer, body: dict, joined: bool) -> None:  # noqa: B027
        """Thread: ``peer`` said hello (``joined``: for the first time on this connection)."""

    def _left(self, ident: bytes, peer: Peer) -> None:  # noqa: B027 - optional hook
        """Thread: ``peer`` said bye and is forgotten."""

    def _other(self, ident: bytes, kind: bytes, body: dict) -> None:
        """Thread: a message other than hello, or a bye from a connection that never said hello."""
        log.debug("weights: ignoring control message %r", kind[:16])

    @abc.abstractmethod
    def _deliver(self) -> None:
        """Thread, after every wake-up (message, version, or timeout): send what is due."""

    @abc.abstractmethod
    def _wait_ms(self) -> int:
        """Thread: the longest the loop may sleep before the next ``_deliver``."""

    def _started(self) -> None:  # noqa: B027 - optional hook
        """Thread, first."""

    def _stopped(self) -> None:  # noqa: B027 - optional hook
        """Thread, last (after ``close`` was called)."""

    # --- caller side -------------------------------------------------------------------------------
    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        check_publish(version, self._last_version, self._closing)
        snap = self._snapshot(version, state_dict)
        with self._lock:
            unsent, self._pending = self._pending, snap
            self._last_version = version
        if unsent is not None:
            self._discard(unsent)
        self._wakeup.set()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._wakeup.set()
        self._thread.join()  # bounded by the transport: every wait of its hooks watches _closing
        self._sock.close()  # returns at once; lingering sends end when written or the peer leaves
        self._wakeup.close()

    # --- thread ------------------------------------------------------------------------------------
    def _send(self, ident: bytes, frames: list, copy: bool = True) -> Sent:
        return send_nonblocking(self._sock, ident, frames, copy)

    def _run(self) -> None:
        self._started()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        while not self._closing:
            events = dict(poller.poll(self._wait_ms()))
            try:
                if self._wakeup.fd in events:
                    self._wakeup.clear()
                    with self._lock:
                        snap, self._pending = self._pending, None
                    if snap is not None and not self._closing:
                        self._take(snap)
                if self._sock in events:
                    self._read_control()
                if not self._closing:
                    self._deliver()
            except Exception:  # noqa: BLE001 - the bus must outlive one bad message or version
                log.exception("weights: %s thread error", self._thread.name)
        self._stopped()

    def _read_control(self) -> None:
        while True:
            try:
                msg = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(msg) != 3:
                log.debug("weights: ignoring control message of %d frames", len(msg))
                continue
            ident, kind = msg[0], msg[1]
            try:
                body = msgpack.unpackb(msg[2])
                name, have = str(body.get("id", "?")), int(body.get("have", -1))
            except Exception:  # noqa: BLE001
                log.debug("weights: ignoring malformed %s", kind[:16])
                continue
            peer = self._peers.get(ident)
            if kind not in (b"hello", b"bye") or (kind == b"bye" and peer is None):
                self._other(ident, kind, body)
            elif kind == b"bye":
                if peer is not None:
                    del self._peers[ident]
                    log.info("weights: subscriber %s left", name)
                    self._left(ident, peer)
            elif peer is None:
                log.info("weights: subscriber %s joined (has version %d)", name, have)
                self._peers[ident] = peer = Peer(name, have)
                self._hello(ident, peer, body, joined=True)
            else:
                self._hello(ident, peer, body, joined=False)


class ControlClient:
    """A subscriber's DEALER: hello (``id``, ``have`` and the ``fields`` of the moment), repeated
    after ``rehello_s`` of silence, and bye on close. Owned by one thread."""

    def __init__(
        self,
        address: str,
        subscriber_id: str,
        fields: Callable[[], dict],
        rehello_s: float,
        rcvhwm: int | None = None,
        secret: str | None = None,
    ) -> None:
        self.subscriber_id, self.rehello_s = subscriber_id, rehello_s
        self._fields = fields
        self._sock = bus_context().socket(zmq.DEALER)
        make_client(self._sock, curve_keys(secret, address))
        if rcvhwm is not None:
            self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sock.setsockopt(zmq.SNDHWM, 16)
        self._sock.setsockopt(zmq.LINGER, 200)  # lets "bye" leave after close
        # No ROUTING_ID: the ROUTER names every connection afresh, so a reconnect is a new peer
        # (whatever was queued to the old connection is gone) and gets the newest version again.
        self._sock.connect(address)
        self._last_contact = time.monotonic()

    def _control(self, kind: bytes, body: dict) -> None:
        try:
            self._sock.send_multipart([kind, msgpack.packb(body)], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # publisher unreachable for now; hello is repeated after rehello_s
        self._last_contact = time.monotonic()

    def hello(self) -> None:
        self._control(b"hello", {"id": self.subscriber_id, **self._fields()})

    def receive(self, timeout_ms: int, copy: bool = True) -> list[list]:
        """Every message that arrived, waiting up to ``timeout_ms`` for the first; says hello again
        when the publisher has been silent for ``rehello_s``."""
        messages: list[list] = []
        self._drain(messages, copy)
        if not messages and timeout_ms > 0 and self._sock.poll(timeout_ms, zmq.POLLIN):
            self._drain(messages, copy)
        now = time.monotonic()
        if messages:
            self._last_contact = now
        elif now - self._last_contact > self.rehello_s:
            self.hello()
        return messages

    def _drain(self, out: list, copy: bool) -> None:
        while True:
            try:
                out.append(self._sock.recv_multipart(zmq.NOBLOCK, copy=copy))
            except zmq.Again:
                return

    def close(self) -> None:
        self._control(b"bye", {"id": self.subscriber_id})
        self._sock.close()
