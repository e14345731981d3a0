"""One learner rank's side of the buffer: judge every entry, keep replays, acknowledge at commit.

Every entry a rank reads ends in exactly one outcome, and the buffer counts it when the entry is
acknowledged (see ``base.py``):

==========  ========================================================  ============================
outcome     when                                                      acknowledged
==========  ========================================================  ============================
foreign     push() did not append it (a raw write to the stream)      at once, onto dead letters
dead        the frame does not decode or validate, or is too large    at once, onto dead letters
stale       its version is outside the lag bound when judged          at once
filtered    dynamic filtering: every sample has the same reward       at once
trained     used in at least one optimizer step                       when a checkpoint that
                                                                      includes it is committed
==========  ========================================================  ============================

Unused outcomes have no effect on the model, so acknowledging them at once is exact and gives
their admission slots back at once. A trained entry stays pending until :meth:`commit`: if the
rank crashes first, the restarted rank gets it back from :meth:`BatchConsumer.recover` and judges
it again at the version it restored. So each entry's effect on the committed model happens once
(``replay_times = R``: at most R times), and no entry is lost.

Replay: an entry trained fewer than ``replay_times`` times stays in the rank's pool while it is
fresh. A step takes new entries first (what is already in the buffer), then replays, and waits for
new entries only when neither fills the batch: a learner never idles while it holds usable data.
The uses of every pending entry go into each checkpoint (:meth:`checkpoint_state`), so a restart
resumes the replay budget where the committed model left it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from asyncrl.buffers.base import Buffer, Entry
from asyncrl.protocol import ProtocolError, TrajectoryGroup, decode_group
from asyncrl.staleness import is_fresh

log = logging.getLogger("asyncrl.buffer")


# Outcomes decided (and acknowledged) as soon as an entry is judged, as ``Batch.counts`` keys.
OUTCOMES_AT_ONCE = ("foreign", "dead", "stale", "filtered")
# what the groups dropped as stale held: their samples and model tokens (the length bias of dropping them; each
# sample's, in Batch.stale_lengths)
STALE_SIZES = ("stale_samples", "stale_tokens")


class StopRequested(SystemExit):
    """The run is stopping while a rank waits for groups (what it had taken is held again)."""


@dataclasses.dataclass(frozen=True)
class ConsumerRules:
    """What a rank accepts: the lag bound, the replay budget, dynamic filtering, the frame size cap."""

    max_policy_lag: int  # k: run.max_policy_lag
    replay_times: int = 1  # buffer.replay_times
    filter_zero_variance: bool = False  # buffer.filter_zero_variance or the preset's dynamic filtering
    max_frame_bytes: int = 64 << 20  # buffer.max_frame_mb


@dataclasses.dataclass
class Held:
    """An entry this rank holds (pending in the buffer) with the group it carries."""

    entry: Entry
    group: TrajectoryGroup
    uses: int = 0  # optimizer steps that used it since the last committed checkpoint's state

    @property
    def entry_id(self) -> str:
        return self.entry.entry_id


@dataclasses.dataclass
class Batch:
    items: list[Held]
    replays: int  # items used before
    counts: dict[str, int]  # outcomes decided while this batch was taken: foreign, dead, stale, filtered
    stale_lengths: list[int] = dataclasses.field(default_factory=list)  # model tokens of each stale sample

    @property
    def groups(self) -> list[TrajectoryGroup]:
        return [h.group for h in self.items]


def judge(group: TrajectoryGroup, version: int, rules: ConsumerRules) -> str | None:
    """Why a decoded group is not usable at learner ``version`` (an outcome), or None if it is."""
    if not is_fresh(version, group.version, rules.max_policy_lag):
        return "stale"
    if rules.filter_zero_variance and np.ptp(group.rewards) == 0:
        return "filtered"
    return None


def decode_checked(entry: Entry, rules: ConsumerRules) -> TrajectoryGroup:
    """The entry's group; :class:`ProtocolError` (the dead-letter reason) if it must not be used."""
    if entry.malformed is not None:
        raise ProtocolError(entry.malformed)
    if not entry.admitted:
        raise ProtocolError("not appended by the buffer's push (no admission): a foreign stream entry")
    if len(entry.frame) > rules.max_frame_bytes:
        raise ProtocolError(f"frame of {len(entry.frame)} bytes exceeds buffer.max_frame_mb")
    return decode_group(entry.frame).trainable()


class BatchConsumer:
    def __init__(self, buffer: Buffer, consumer: str, rules: ConsumerRules):
        self.buffer = buffer
        self.consumer = consumer
        self.rules = rules
        self.pool: dict[str, Held] = {}  # trained, budget left, pending: replay candidates
        self.done: dict[str, Held] = {}  # trained, budget spent or stale: acknowledged at commit
        self.fresh: list[Held] = []  # judged usable, never trained (recovered or read ahead)
        self.totals = dict.fromkeys((*OUTCOMES_AT_ONCE, *STALE_SIZES, "replays"), 0)
        self._stale_lengths: list[int] = []  # the samples of groups dropped as stale since the last batch

    # ----- taking a batch ---------------------------------------------------------------------

    def take(self, need: int, version: int, block_ms: int, stop: Callable[[], bool] = lambda: False) -> Batch:
        """``need`` usable groups for the step at ``version``: new ones first, then replays, then
        wait for new ones. Entries found unusable on the way are acknowledged with their outcome."""
        counts = dict.fromkeys((*OUTCOMES_AT_ONCE, *STALE_SIZES), 0)
        self._retire_stale_replays(version)
        new = self._take_fresh(need, version, counts)
        while len(new) < need:  # everything already in the buffer comes before replays
            entries = self.buffer.read(self.consumer, need - len(new), 0)
            if not entries:
                break
            new += self._accept(entries, version, counts)
        replays = self._take_replays(need - len(new), version)
        while len(new) + len(replays) < need:
            if stop():
                self.fresh = new + self.fresh  # still held, pending: taken by the next call
                self.pool.update((h.entry_id, h) for h in replays)
                self._add_totals(counts)
                raise StopRequested("stop requested while waiting for trajectory groups")
            entries = self.buffer.read(self.consumer, need - len(new) - len(replays), block_ms)
            if not entries:
                entries = self._adopt_orphans(taking=new + replays)
            new += self._accept(entries, version, counts)
        items = new + replays
        if replays:
            # one token per rank and version: a step redone after a learner restart takes its
            # replays' slots once, not again (else each crash would shrink the admission window)
            self.buffer.record_replays(len(replays), token=f"replays:{self.consumer}:{version}")
        self._add_totals(counts)
        self.totals["replays"] += len(replays)
        lengths, self._stale_lengths = self._stale_lengths, []
        return Batch(items, len(replays), counts, lengths)

    def give_back(self, batch: Batch) -> None:
        """A taken batch that no step will use (the run stops while another rank waits): held again,
        as a stop during :meth:`take` leaves what it had taken."""
        self.fresh = [h for h in batch.items if h.uses == 0] + self.fresh
        self.pool.update((h.entry_id, h) for h in batch.items if h.uses > 0)

    def _add_totals(self, counts: dict[str, int]) -> None:
        for key, n in counts.items():
            self.totals[key] += n

    def _take_fresh(self, need: int, version: int, counts: dict[str, int]) -> list[Held]:
        items, keep = [], []
        for held in self.fresh:
            reason = judge(held.group, version, self.rules)
            if reason is not None:
                self._ack_unused([held.entry], reason, counts, [held.group])
            elif len(items) < need:
                items.append(held)
            else:
                keep.append(held)
        self.fresh = keep
        return items

    def _take_replays(self, need: int, version: int) -> list[Held]:
        if need <= 0 or not self.pool:
            return []
        # fewest uses first, then oldest policy (it goes stale first)
        order = sorted(self.pool.values(), key=lambda h: (h.uses, h.group.version))
        chosen = order[:need]
        for held in chosen:
            del self.pool[held.entry_id]
        return chosen

    def _retire_stale_replays(self, version: int) -> None:
        for held in list(self.pool.values()):
            if judge(held.group, version, self.rules) is not None:
                del self.pool[held.entry_id]
                self.done[held.entry_id] = held  # trained already: acknowledged as trained at commit

    def _accept(self, entries: list[Entry], version: int, counts: dict[str, int]) -> list[Held]:
        """Judge newly read entries; acknowledge the unusable ones now; return the usable ones."""
        usable: list[Held] = []
        unused: dict[str, list[Entry]] = {"stale": [], "filtered": []}
        stale: list[TrajectoryGroup] = []
        for entry in entries:
            try:
                group = decode_checked(entry, self.rules)
            except ProtocolError as exc:
                counter = self.buffer.dead_letter(entry, str(exc))
                if counter is not None:
                    counts[counter] += 1
                log.warning("dead letter %s from %s: %s", entry.entry_id, entry.producer, exc)
                continue
            reason = judge(group, version, self.rules)
            if reason is None:
                usable.append(Held(entry, group))
            else:
                unused[reason].append(entry)
                stale += [group] if reason == "stale" else []
        for reason, unusable in unused.items():
            self._ack_unused(unusable, reason, counts, stale if reason == "stale" else [])
        return usable

    def _ack_unused(self, entries: list[Entry], reason: str, counts: dict[str, int], groups=()) -> None:
        """Acknowledge ``entries`` as unused for ``reason``; stale ones' ``groups`` are counted by size."""
        if entries:
            counts[reason] += self.buffer.ack(entries, reason)
        for group in groups:
            counts["stale_samples"] += len(group.samples)
            counts["stale_tokens"] += group.num_tokens
            self._stale_lengths += [int(s.mask.sum()) for s in group.samples]

    def _adopt_orphans(self, taking: list[Held]) -> list[Entry]:
        """Entries pending for this consumer that it does not hold: a read whose reply was lost
        (e.g. the server died mid-reply) delivered them. Without this they would wait forever."""
        held = set(self.pool) | set(self.done) | {h.entry_id for h in (*self.fresh, *taking)}
        if held.issuperset(self.buffer.pending_ids(self.consumer)):
            return []  # the usual case, cheaply: ids only
        orphans = [e for e in self.buffer.pending(self.consumer) if e.entry_id not in held]
        if orphans:
            log.warning("adopting %d entries delivered to %s by a lost read", len(orphans), self.consumer)
        return orphans

    # ----- after the step, at commit, at restart --------------------------------------------

    def trained(self, batch: Batch) -> None:
        """The optimizer step that used ``batch`` is done."""
        for held in batch.items:
            held.uses += 1
            if held.uses >= self.rules.replay_times:
                self.done[held.entry_id] = held
            else:
                self.pool[held.entry_id] = held

    def checkpoint_state(self) -> dict[str, int]:
        """Uses of every trained entry still pending, for the checkpoint being written."""
        return {h.entry_id: h.uses for h in (*self.pool.values(), *self.done.values())}

    def commit(self, final: bool = False) -> int:
        """The checkpoint whose :meth:`checkpoint_state` was saved is committed: acknowledge the
        trained entries that are done (``final``: every trained entry, the run is over). Returns
        how many were acknowledged."""
        if final:
            self.done.update(self.pool)
            self.pool.clear()
        entries = [h.entry for h in self.done.values()]
        n = self.buffer.ack(entries, "trained") if entries else 0
        self.done.clear()
        return n

    def recover(self, version: int, uses: dict[str, int]) -> dict[str, int]:
        """After a restart from the checkpoint at ``version`` whose state was ``uses``: take back
        every entry this consumer had pending and judge it again. Returns outcome counts."""
        counts = dict.fromkeys((*OUTCOMES_AT_ONCE, *STALE_SIZES, "trained", "replay", "fresh"), 0)
        entries = self.buffer.pending(self.consumer)
        trained = []
        for entry in entries:
            used = uses.get(entry.entry_id, 0)
            if used == 0:
                usable = self._accept([entry], version, counts)
                self.fresh += usable
                counts["fresh"] += len(usable)
                continue
            group = decode_checked(entry, self.rules)  # it decoded when it was trained
            held = Held(entry, group, used)
            if used >= self.rules.replay_times or judge(group, version, self.rules) is not None:
                trained.append(entry)  # its effect is in the committed model
            else:
                self.pool[entry.entry_id] = held
                counts["replay"] += 1
        if trained:
            counts["trained"] = self.buffer.ack(trained, "trained")
        self._stale_lengths.clear()  # sizes are counted for the steps' records, and no step takes these
        return {k: n for k, n in counts.items() if k not in STALE_SIZES}  # outcomes only
