"""The generator's one handle on new weights, shared by its loop and its engine.

``WeightFeed`` wraps the weight-bus subscriber. Whoever may load weights asks it for a version
newer than the one served (``newer``), loads that version's tensors, and tells it (``applied``): the
generator's engine pump, between engine steps. Nothing calls back into the generator.

Invariants: ``version`` is the version the engine serves; it only moves forward, and only through
``applied``, after the engine holds that version's tensors. ``newer`` returns only complete,
verified versions (the subscriber's guarantee) newer than ``version``. Metrics: every applied version
logs ``generator/version`` and ``weights/*`` (apply time, receive-to-apply time and how much of it an
evaluation held the weights, publish and apply wall clocks, bytes) and beats the heartbeat with its
checksum; a change of the subscriber's rejection count logs ``weights/rejected``.
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
        probe_ids: list[int] | None = None,
        compare: Callable[..., dict[str, float]] | None = None,
        sampled: Callable[[int], list[int] | None] | None = None,
        aliases: dict[str, str] | None = None,
        adapter: tuple[str, float] | None = None,
    ) -> None:
        """``metrics`` is a sink (``log(record)``); ``heartbeat(version=, checksum=)`` says which
        weights this process serves now. ``version`` is the one loaded at start (the weights on disk).
        ``probe_ids``: the sequence the engine scores after each apply (``asyncrl.observe.probe``), and
        ``compare(version, logprobs, routing)`` the record's figures against the learner's probe
        (``asyncrl.observe.probe.compare``: the log-prob difference, a mixture of experts' routing difference);
        ``sampled(version)``: the sampled sequence the learner probed ``version`` on instead, if any
        (``asyncrl.observe.probe.ids_of``).
        ``aliases``: the model's tied names (``asyncrl.weights.ties``), put back into each version.
        ``adapter``: (``model.path``, alpha / rank) of a LoRA run, whose versions are adapters merged into
        the base weights read from that path (``asyncrl.weights.lora``)."""
        self.subscriber = subscriber
        self.version = version
        self.probe_ids, self._compare, self._sampled = probe_ids, compare, sampled
        self.aliases = aliases or {}
        self.adapter = adapter
        self._base: dict | None = None  # a LoRA run's base weights, read at the first adapter version
        self._metrics = metrics
        self._heartbeat = heartbeat
        self._rejected = 0  # the subscriber's rejection count last logged
        self._pending: dict | None = None  # the last version's record, waiting for its probe

    def probe_for(self, update: WeightUpdate) -> list[int] | None:
        """The sequence the engine scores after applying ``update``: the learner's sampled one where it probed
        one, else the fixed probe (None: no probe in this run)."""
        if not self.probe_ids:
            return None
        return (self._sampled is not None and self._sampled(update.version)) or self.probe_ids

    def newer(self, timeout_ms: int = 0) -> WeightUpdate | None:
        """The newest verified version newer than ``version`` (waiting up to ``timeout_ms``), or None."""
        update = self.subscriber.poll(timeout_ms)
        if self.subscriber.rejected != self._rejected:  # the subscriber logged why
            self._rejected = self.subscriber.rejected
            self._metrics.log({"weights/rejected": self._rejected, "generator/version": self.version})
        if update is None or update.version <= self.version:
            return None
        return update

    def engine_tensors(self, update: WeightUpdate) -> dict:
        """Every weight the engine loads for ``update``: its tensors with the tied names put back, or for
        an adapter version the base weights with each adapted one merged."""
        from asyncrl.weights.lora import base_state, is_adapter, merge
        from asyncrl.weights.ties import retied

        tensors = update.tensors
        if is_adapter(tensors):
            if self.adapter is None:
                raise ValueError(f"version {update.version} is a LoRA adapter, and this run has no model.lora")
            if self._base is None:
                self._base = base_state(self.adapter[0])
            tensors = {**self._base, **merge(self._base, tensors, self.adapter[1])}
        return retied(tensors, self.aliases)

    def applied(
        self,
        update: WeightUpdate,
        seconds: float,
        probe: list[float] | None = None,
        routing: list | None = None,
        probe_to_come: bool = False,
        held_seconds: float = 0.0,
    ) -> None:
        """The engine serves ``update`` now; loading it took ``seconds``; ``probe``: the engine's
        log-probs of ``probe_ids`` with it, and ``routing`` its expert choices there (a mixture of experts);
        ``probe_to_come``: the engine scores the probe with its next step, and the version's record waits
        for it (``probed``); ``held_seconds``: how long it waited for an evaluation that held the weights."""
        self._log_pending()
        self.version = update.version
        self._heartbeat(version=self.version, checksum=update.checksum)
        now = time.time()
        record = {
            "generator/version": self.version,
            "weights/apply_seconds": seconds,
            "weights/receive_to_apply_seconds": now - update.received_at,
            "weights/held_seconds": held_seconds,  # of those, behind an evaluation (it sees one version)
            "weights/published_at": update.published_at,
            "weights/applied_at": now,
            "weights/bytes": update.nbytes,
            "weights/checksum": update.checksum,  # the bytes applied: the publisher's, verified
            **sent_metrics(update.sent),
        }
        if probe_to_come:
            self._pending = record
            return
        if probe is not None and self._compare is not None:
            record.update(self._compare(self.version, probe, routing))
        self._metrics.log(record)

    def probed(self, probe: list[float] | None) -> None:
        """The engine's log-probs of ``probe_ids`` under the version applied last (``probe_to_come``), or
        None where it dropped the probe unscored: that version's record goes out."""
        if probe is not None and self._pending is not None and self._compare is not None:
            self._pending.update(self._compare(self._pending["generator/version"], probe, None))
        self._log_pending()

    def _log_pending(self) -> None:
        record, self._pending = self._pending, None
        if record is not None:
            self._metrics.log(record)


def sent_metrics(sent: dict) -> dict:
    """How a version crossed the bus (``WeightUpdate.sent``): its bytes on the wire, whether it was a delta,
    the fraction of elements that changed (a delta), or why it went full (a full one)."""
    if not sent:
        return {}
    record = {"weights/sent_bytes": sent.get("bytes"), "weights/delta": 1.0 if sent.get("kind") == "delta" else 0.0}
    if sent.get("changed_fraction") is not None:
        record["weights/changed_fraction"] = sent["changed_fraction"]
    reason = sent.get("full_reason")
    if sent.get("asked"):
        reason = "this generator asked for it (a delta did not apply)"
    if sent.get("kind") == "full" and reason:
        record["weights/full_reason"] = reason
    return record
