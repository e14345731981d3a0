"""The collective bus's subscriber (protocol in ``collective_bus``).

Concurrency: a background thread owns the ZeroMQ socket and the epoch's group; it receives each
version into buckets of its own and leaves the newest verified one in a slot that ``poll`` takes,
so a generator busy in its engine delays nobody. Its device memory holds two or three versions (the
one the caller applied and still holds, the one in the slot, the one arriving).
"""

from __future__ import annotations

import datetime
import threading

import msgpack
import torch
import torch.distributed as dist

from asyncrl.weights.base import BackgroundSubscriber, Mailbox, log, log_rejection
from asyncrl.weights.collective_buckets import build_update, check_manifest
from asyncrl.weights.collective_bus import IDLE_MS
from asyncrl.weights.collective_group import Group, arrived_key, gloo_host, resolve_device, split_tcp
from asyncrl.weights.control_plane import ControlClient
from asyncrl.weights.wire import WeightsRejected


class CollectiveWeightSubscriber(BackgroundSubscriber):
    def __init__(
        self,
        address: str,
        subscriber_id: str,
        have: int = -1,
        backend: str = "nccl",
        device: str | torch.device = "cuda",
        timeout_s: float = 30.0,
        rehello_s: float = 5.0,
        secret: str | None = None,
    ) -> None:
        self.address, self.subscriber_id = address, subscriber_id
        self.latest_version, self.rejected = have, 0
        self.backend, self.device = backend, resolve_device(device)
        self.timeout_s = timeout_s
        self._host, _ = split_tcp(address)
        self._mailbox = Mailbox()  # newest verified version not yet taken by poll
        self._newest = have  # newest version received (verified or not), thread side
        self._closed = False
        self._store = None
        self._store_port = 0
        self._seen_epoch = -1
        self._group: Group | None = None
        self._client = ControlClient(address, subscriber_id, self._hello_fields, rehello_s, secret=secret)
        self._thread = threading.Thread(target=self._run, name="weights-collective-sub", daemon=True)
        self._thread.start()

    # --- caller side ---------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._thread.join()  # bounded: collectives stop on _closed, control waits are IDLE_MS

    # --- background thread ---------------------------------------------------------------------
    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._client.hello()
        while not self._closed:
            messages = self._client.receive(IDLE_MS)
            try:
                self._handle(messages)
            except Exception:  # noqa: BLE001 - the bus must outlive one bad message
                log.exception("weights: collective subscriber thread error")
        self._leave_group()
        self._client.close()

    def _hello_fields(self) -> dict:
        epoch = self._group.epoch if self._group is not None else -1
        return {"have": self._newest, "epoch": epoch, "seen": self._seen_epoch}

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
            self._client.hello()

    def _receive(self, manifest: dict) -> None:
        version = manifest.get("version")
        try:
            sizes = check_manifest(manifest)
        except WeightsRejected as exc:
            # Without bucket sizes we cannot take part in the broadcast: leave, ask for a new group.
            self._reject(version, str(exc))
            self._leave_group()
            self._client.hello()
            return
        buckets = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        try:
            for bucket in buckets:
                self._group.broadcast(bucket, self.timeout_s, lambda: self._closed)
        except Exception as exc:  # noqa: BLE001 - the group failed; the publisher re-forms it
            if not self._closed:
                epoch = self._group.epoch
                log.warning("weights: %s lost version %s in epoch %d: %s", self.subscriber_id, version, epoch, str(exc))
                self._leave_group()
                self._client.hello()
            return
        if version <= self._newest:
            return  # a re-send for a late joiner: we have it already
        try:
            update = build_update(manifest, buckets, self.device)
        except WeightsRejected as exc:
            self._reject(version, str(exc))
            return
        self._newest = update.version
        self._mailbox.put(update)

    def _reject(self, version: object, reason: str) -> None:
        self.rejected += 1
        log_rejection(self.subscriber_id, version, reason, self._newest)
