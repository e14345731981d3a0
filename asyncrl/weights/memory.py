"""In-memory weight bus: publisher and subscribers in one process, same semantics as ZeroMQ.

Versions go through the real wire format (``encode`` on publish, full verification on ``poll``),
so generator logic tested against it sees exactly what it would see over sockets: newest version
wins, late subscribers get the newest version at once, corrupted versions are rejected.
"""

from __future__ import annotations

import collections
import threading
import uuid
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncrl.weights.base import VerifyingSubscriber, WeightPublisher, check_publish
from asyncrl.weights.wire import encode

if TYPE_CHECKING:
    import torch

# Messages a subscriber's inbox holds, like the ZeroMQ receive HWM; older ones fall out.
_INBOX = 2

# Buses by name, alive while a publisher, subscriber or test holds one.
_BUSES: weakref.WeakValueDictionary[str, MemoryWeightBus] = weakref.WeakValueDictionary()
_BUSES_LOCK = threading.Lock()


class MemoryWeightBus:
    """One named bus (``memory://name``); ``get(address)`` finds it again within the process."""

    def __init__(self, name: str | None = None, bucket_bytes: int = 64 << 20) -> None:
        self.name = name or uuid.uuid4().hex[:12]
        self.address = f"memory://{self.name}"
        self.bucket_bytes = bucket_bytes
        self._cond = threading.Condition()
        self._newest: tuple[int, list] | None = None
        self._subscribers: set[MemoryWeightSubscriber] = set()
        with _BUSES_LOCK:
            _BUSES[self.name] = self

    @staticmethod
    def get(address: str, create: bool = False, bucket_bytes: int = 64 << 20) -> MemoryWeightBus:
        name = address.removeprefix("memory://")
        with _BUSES_LOCK:
            bus = _BUSES.get(name)
        if bus is None:
            if not create:
                raise KeyError(f"no memory weight bus at {address}")
            bus = MemoryWeightBus(name, bucket_bytes)
        return bus

    def publisher(self) -> MemoryWeightPublisher:
        return MemoryWeightPublisher(self)

    def subscriber(self, subscriber_id: str, have: int = -1) -> MemoryWeightSubscriber:
        sub = MemoryWeightSubscriber(self, subscriber_id, have)
        with self._cond:
            self._subscribers.add(sub)
            if self._newest is not None and self._newest[0] > have:
                sub._inbox.append(self._newest[1])  # late joiner: newest version at once
        return sub

    def _deliver(self, version: int, frames: list) -> None:
        with self._cond:
            self._newest = (version, frames)
            for sub in self._subscribers:
                sub._inbox.append(frames)
            self._cond.notify_all()

    def _leave(self, sub: MemoryWeightSubscriber) -> None:
        with self._cond:
            self._subscribers.discard(sub)


class MemoryWeightPublisher(WeightPublisher):
    def __init__(self, bus: MemoryWeightBus) -> None:
        self.bus = bus
        self.address = bus.address
        self._last_version: int | None = None
        self._closed = False
        self._versions = 0

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        if self._closed:
            raise RuntimeError("publish on a closed weight publisher")
        check_publish(version, self._last_version)
        self._last_version = version
        self.bus._deliver(version, encode(version, state_dict, self.bus.bucket_bytes))
        self._versions += 1

    def stats(self) -> dict[str, int]:
        return {"versions": self._versions, "subscribers": len(self.bus._subscribers)}

    def close(self) -> None:
        self._closed = True


class MemoryWeightSubscriber(VerifyingSubscriber):
    def __init__(self, bus: MemoryWeightBus, subscriber_id: str, have: int = -1) -> None:
        super().__init__(subscriber_id, have)
        self.bus = bus
        self.address = bus.address
        self._inbox: collections.deque[list] = collections.deque(maxlen=_INBOX)
        self._closed = False

    def _receive(self, timeout_ms: int) -> list[Sequence]:
        if self._closed:
            raise RuntimeError("poll on a closed weight subscriber")
        with self.bus._cond:
            if not self._inbox and timeout_ms > 0:
                self.bus._cond.wait_for(lambda: bool(self._inbox), timeout_ms / 1000)
            messages = list(self._inbox)
            self._inbox.clear()
        return messages

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.bus._leave(self)
