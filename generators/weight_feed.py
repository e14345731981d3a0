"""The generator's one handle on new weights, shared by its loop and its engine.

``WeightFeed`` wraps the weight-bus subscriber. Whoever may load weights asks it for a version
newer than the one served (``newer``), loads that version's tensors, and tells it (``applied``): the
generator's engine pump, between engine steps. Nothing calls back into the generator.

Invariants: ``version`` is the version the engine serves; it only moves forward, and only through
``applied``, after the engine holds that version's tensors. ``newer`` returns only complete,
verified versions (the subscriber's guarantee) newer than ``version``. Metrics: every applied version
logs ``generator/version`` and ``weights/*`` (apply time, receive-to-apply time, publish and apply
wall clocks, bytes) and beats the heartbeat with its checksum; a change of the subscriber's
rejection count logs ``weights/rejected``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.weights import WeightSubscriber, WeightUpdate


class WeightFeed:
    def __init__(
        self,
        subscriber: WeightSubscriber,
        metrics,
        heartbeat: Callable[..., None],
        version: int = 0,
    ) -> None:
        """``metrics`` is a sink (``log(record)``); ``heartbeat(version=, checksum=)`` says which
        weights this process serves now. ``version`` is the one loaded at start (the weights on disk)."""
        self.subscriber = subscriber
        self.version = version
        self._metrics = metrics
        self._heartbeat = heartbeat
        self._rejected = 0  # the subscriber's rejection count last logged

    def newer(self, timeout_ms: int = 0) -> WeightUpdate | None:
        """The newest verified version newer than ``version`` (waiting up to ``timeout_ms``), or None."""
        update = self.subscriber.poll(timeout_ms)
        if self.subscriber.rejected != self._rejected:  # the subscriber logged why
            self._rejected = self.subscriber.rejected
            self._metrics.log({"weights/rejected": self._rejected, "generator/version": self.version})
        if update is None or update.version <= self.version:
            return None
        return update

    def applied(self, update: WeightUpdate, seconds: float) -> None:
        """The engine serves ``update`` now; loading it took ``seconds``."""
        self.version = update.version
        self._heartbeat(version=self.version, checksum=update.checksum)
        now = time.time()
        self._metrics.log(
            {
                "generator/version": self.version,
                "weights/apply_seconds": seconds,
                "weights/receive_to_apply_seconds": now - update.received_at,
                "weights/published_at": update.published_at,
                "weights/applied_at": now,
                "weights/bytes": update.nbytes,
            }
        )
