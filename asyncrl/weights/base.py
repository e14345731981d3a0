"""Weight bus interfaces and the subscriber logic every transport shares.

Concurrency contract: a publisher's ``publish`` may be called from any one thread and returns after
copying the state dict (the caller may then change its tensors); delivery happens elsewhere and
never waits on a subscriber. A subscriber belongs to the one thread that calls ``poll``; ``poll``
only ever returns complete, verified versions, newest first, each newer than the last one returned,
so a generator can call it between engine steps and apply what it gets without further checks.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncrl.weights.delta import Held
from asyncrl.weights.wire import WeightsRejected, WeightUpdate, decode, peek_version

if TYPE_CHECKING:
    import torch

log = logging.getLogger("asyncrl.weights")


def check_publish(version: int, last_version: int | None, closing: bool = False) -> None:
    """What every transport's ``publish`` refuses: a closed publisher, a version not newer."""
    if closing:
        raise RuntimeError("publish on a closed weight publisher")
    if last_version is not None and version <= last_version:
        raise ValueError(f"version {version} is not newer than {last_version}")


def log_rejection(subscriber_id: str, version: object, reason: str, keeping: int) -> None:
    """The one log line of every rejected version (each subscriber also counts it in ``rejected``)."""
    log.warning("weights: %s rejected version %s: %s (keeping version %d)", subscriber_id, version, reason, keeping)


class WeightPublisher(abc.ABC):
    """Learner rank 0's end: hands each new version to every subscriber, newest wins."""

    address: str  # what subscribers connect to (the resolved endpoint)

    @abc.abstractmethod
    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Snapshot ``state_dict`` as ``version`` (strictly increasing) and send it in the background."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def stats(self) -> dict[str, int]:
        return {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Mailbox:
    """One slot, newest wins: a subscriber's background thread ``put``s each verified version, the
    thread that polls ``take``s it (waiting up to ``timeout_ms``); a version not taken is replaced."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._slot: WeightUpdate | None = None

    def put(self, update: WeightUpdate) -> None:
        with self._cond:
            self._slot = update
            self._cond.notify_all()

    def take(self, timeout_ms: int) -> WeightUpdate | None:
        with self._cond:
            self._cond.wait_for(lambda: self._slot is not None, max(timeout_ms, 0) / 1000)
            update, self._slot = self._slot, None
        return update


class WeightSubscriber(abc.ABC):
    """A generator's end. ``latest_version`` is the last version ``poll`` returned (or ``have``)."""

    latest_version: int
    rejected: int  # received versions that failed verification

    @abc.abstractmethod
    def poll(self, timeout_ms: int = 0) -> WeightUpdate | None:
        """The newest complete, verified version newer than ``latest_version``, or None."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BackgroundSubscriber(WeightSubscriber):
    """A subscriber whose own thread receives and verifies versions and ``put``s them in
    ``self._mailbox``; ``poll`` takes the newest one that is newer than the last it returned."""

    _closed: bool
    _mailbox: Mailbox

    def poll(self, timeout_ms: int = 0) -> WeightUpdate | None:
        if self._closed:
            raise RuntimeError("poll on a closed weight subscriber")
        update = self._mailbox.take(timeout_ms)
        if update is None or update.version <= self.latest_version:
            return None
        self.latest_version = update.version
        return update


class VerifyingSubscriber(WeightSubscriber):
    """``poll`` on top of a transport's ``_receive``: pick the newest message, verify, skip older.

    Deltas (``delta``): a delta applies to the version returned last, so when several arrived together
    they apply in order from the newest full one among them (or the held version); one that cannot
    apply (no base, a failed check) is rejected, the held version stays, and ``_want_full`` asks the
    transport for a full version."""

    def __init__(self, subscriber_id: str, have: int = -1) -> None:
        self.subscriber_id = subscriber_id
        self.latest_version = have
        self.rejected = 0
        self.held = Held()  # what deltas apply to
        self.wants_full = False  # a delta could not apply: the next version must be full

    @abc.abstractmethod
    def _receive(self, timeout_ms: int) -> list[Sequence]:
        """All complete messages that arrived (waiting up to ``timeout_ms`` for the first)."""

    def _want_full(self) -> None:  # noqa: B027 - optional hook
        """A delta could not apply (``wants_full`` is set): tell the publisher, if the transport can."""

    def poll(self, timeout_ms: int = 0) -> WeightUpdate | None:
        deadline = time.monotonic() + max(timeout_ms, 0) / 1000
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            update = self._select(self._receive(remaining_ms))
            if update is not None or remaining_ms <= 0:
                return update

    def _reject(self, version: object, reason: str) -> None:
        self.rejected += 1
        log_rejection(self.subscriber_id, version, reason, self.latest_version)

    def _select(self, messages: list[Sequence]) -> WeightUpdate | None:
        candidates = []
        for frames in messages:
            try:
                version, manifest = peek_version(frames)
            except WeightsRejected as exc:
                self._reject("?", str(exc))
                continue
            if version > self.latest_version:
                candidates.append((version, manifest, frames))
        candidates.sort(key=lambda c: c[0])
        fulls = [i for i, (_, manifest, _) in enumerate(candidates) if not isinstance(manifest.get("delta"), dict)]
        # From the newest full version on (older ones are skipped without the cost of checking; if it
        # fails, from the one before), or from the held version: each delta applies to the one before.
        update, missed, failed = None, False, set()
        for start in dict.fromkeys([*reversed(fulls), 0]):
            update, missed = self._chain(candidates[start:], failed)
            if update is not None:
                break
        if missed and not self.wants_full:
            self.wants_full = True
            log.info("weights: %s asks for a full version (a delta did not apply)", self.subscriber_id)
            self._want_full()
        return update

    def _chain(self, candidates: list, failed: set[int]) -> tuple[WeightUpdate | None, bool]:
        """Take ``candidates`` in order, but those in ``failed`` (where the ones that fail go): the last version
        that verified, and whether a delta could not apply after it."""
        update, missed = None, False
        for version, manifest, frames in candidates:
            delta = manifest.get("delta")
            if version in failed:
                missed = missed or isinstance(delta, dict)
                continue
            if isinstance(delta, dict) and delta.get("base") != self.held.version:
                missed = True  # its base never came here (or failed): only a full version helps
                continue
            try:
                update = self.held.take(decode(frames, manifest), manifest)
            except WeightsRejected as exc:
                self._reject(version, str(exc))
                failed.add(version)
                missed = missed or isinstance(delta, dict)
                continue
            self.latest_version = update.version
            if self.wants_full and not isinstance(delta, dict):
                update.sent["asked"] = True  # the full version this subscriber asked for
                self.wants_full = False
            missed = False
        return update, missed
