"""The trajectory buffer between generators and learner ranks: interface and shared types.

Who calls what:

* generators: :meth:`Buffer.try_start_group` before generating a group (admission control), then
  :meth:`Buffer.push` with the encoded group, or :meth:`Buffer.release` if the group is abandoned,
  each naming the generator as ``producer``;
* the launcher: :meth:`Buffer.release_held` for a generator that died (or every one, on a resume);
* generators whose episodes can outlive them (an environment in ``asyncrl env-serve``): :meth:`Buffer.journal`
  after each turn, and :meth:`Buffer.take_orphan` to resume the groups of a generator that died;
* learner ranks, through :class:`asyncrl.buffers.consumer.BatchConsumer`: :meth:`Buffer.read`
  (each entry is delivered to exactly one consumer), then one outcome per entry:
  :meth:`Buffer.ack` with ``trained`` once the checkpoint that includes its update is committed,
  or at once with ``stale`` / ``filtered``, or :meth:`Buffer.dead_letter` for a frame that is bad;
  :meth:`Buffer.pending` after a restart to get back what was delivered but never acknowledged;
* learner rank 0: :meth:`Buffer.set_version` after each optimizer step.

Invariants every implementation keeps, under any number of concurrent callers (threads for the
memory buffer; threads and processes for Redis):

* **admission bound**: a group is admitted only while
  ``live = started + replayed - abandoned - failed - dropped_stale - filtered - dead`` is below
  :func:`asyncrl.staleness.admission_limit` of the caller's ``serving_version``, so the groups
  admitted and not given back never exceed the limit of the largest serving version any caller
  passed. Groups that never reach a gradient give their slot back; a replay takes one (a step
  uses ``B`` groups, new or replayed), which only makes admission stricter. The check and the
  increment are one atomic step, and a retried admission (lost reply) gets its first answer back,
  so racing or reconnecting generators cannot overshoot.
* **held groups**: a group admitted for a ``producer`` is held by it until that producer's push or
  release of it, in the same atomic step as the admission, push or release; so a producer that
  dies at any instant holds exactly the groups it will never push, and :meth:`release_held` gives
  their slots back, no more and no fewer.
* **journals**: a group may keep a journal (its episodes' states, by part) while its producer holds
  it; its push or release ends the journal in the same atomic step. When its producer dies, a
  journaled group becomes an *orphan* instead of being given back: its slot stays taken (it is
  still unfinished) until a generator takes it (:meth:`take_orphan`, which makes it that
  generator's) and pushes or releases it.
* **at most one append per group id**: a second push of the same id is a no-op that returns False.
* **exactly-one delivery**: an entry returned by :meth:`read` to one consumer is never returned by
  :meth:`read` to another; it stays *pending* until acknowledged (:meth:`pending` gives a restarted
  consumer its own back).
* **every pushed group is accounted for**: ``pushed = trained + dropped_stale + filtered + dead +
  queued + pending - foreign_in_buffer``, whatever else is written to the stream; outcome counters
  move only together with the acknowledgement that removes the entry, so a retried acknowledgement
  counts once. Entries that push() did not append are ``foreign``: a consumer dead-letters them
  unread (:attr:`Entry.admitted`), and they are counted apart.
* counters only grow (except ``queued``/``pending``, which are gauges).
"""

from __future__ import annotations

import dataclasses
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence

# Counters every implementation reports from :meth:`Buffer.stats` (``queued``/``pending`` are gauges).
COUNTER_KEYS = (
    "started",  # groups admitted by try_start_group
    "pushed",  # distinct groups appended
    "duplicates",  # pushes ignored because the group id was seen before
    "abandoned",  # admitted groups that will never be pushed (slots given back)
    "failed",  # admitted groups whose episodes failed (episode.failure_policy): never pushed, slots given back
    "trained",  # groups acknowledged after a committed checkpoint included their update
    "dropped_stale",  # groups acknowledged unused: older than the lag bound (slots given back)
    "filtered",  # groups acknowledged unused: dynamic filtering, e.g. zero reward variance (slots given back)
    "dead",  # frames acknowledged onto the dead-letter stream (slots given back)
    "replayed",  # extra trainings of a group beyond its first (each takes a slot)
    "resumed",  # orphaned groups (a journal, their producer dead) taken over by another generator
    "foreign",  # entries push() never appended (a raw write to the stream, a copy of a pushed group id):
    # dead-lettered when read, counted only here; they never take or give back an admission slot
)
STAT_KEYS = (
    *COUNTER_KEYS,
    "queued",  # gauge: entries appended but not yet delivered to any consumer (foreign ones included)
    "pending",  # gauge: entries delivered but not yet acknowledged (foreign ones included)
    "foreign_in_buffer",  # gauge: foreign entries among queued + pending
)
# Outcomes :meth:`Buffer.ack` accepts, and the counter each one moves.
OUTCOMES = {"trained": "trained", "stale": "dropped_stale", "filtered": "filtered"}

# How many recent group ids the duplicate check remembers. Duplicates come from retried pushes
# seconds apart, so this is generous; it bounds the memory of a long run (about 100 B per id).
SEEN_WINDOW = 1 << 17
# A retried admission or release within this long gets the answer of its first attempt.
IDEMPOTENCY_TTL_S = 600

# Dead letters keep at most this much of the offending frame: enough to debug, and an oversize
# frame (one of the reasons to dead-letter) must not blow up the buffer's memory a second time.
DEAD_FRAME_MAX_BYTES = 1 << 20
# The dead-letter stream keeps about this many recent entries; the `dead` counter counts all.
DEAD_MAX_ENTRIES = 1000


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One trajectory group as delivered to a learner rank."""

    entry_id: str  # buffer-assigned, increasing in append order (a Redis stream id like "17-0")
    frame: bytes  # the msgpack frame as pushed (see asyncrl.protocol); b"" when the entry has none
    producer: str = "unknown"  # who pushed it, as they said at push time
    gid: str = ""  # the group id it was pushed under
    admitted: bool = True  # appended by push() and not acknowledged yet; False: a foreign entry
    malformed: str | None = None  # why the entry's fields are unusable (no frame, ...), if they are


@dataclasses.dataclass(frozen=True, slots=True)
class DeadLetter:
    """A frame a learner could not use, with why and who sent it."""

    reason: str
    producer: str
    size: int  # size of the original frame in bytes
    frame: bytes  # the first DEAD_FRAME_MAX_BYTES of the frame


# Groups holding an admission slot: the counters that take a slot minus those that give it back (see
# the module doc). ``live_groups`` and the Redis admission script are both built from these two tuples.
SLOT_TAKERS = ("started", "replayed")
SLOT_RETURNERS = ("abandoned", "failed", "dropped_stale", "filtered", "dead")
RELEASE_REASONS = ("abandoned", "failed")  # what :meth:`Buffer.release` may count an unpushed group as
# the journal part of a group's claim, written by its admission when a producer holds it: a group admitted in the
# instant before its generator dies is an orphan too, played again, never skipped (asyncrl.generators.journal)
CLAIM_PART = "-1"


def live_groups(counts: dict[str, int]) -> int:
    """Groups holding an admission slot: started or replayed, and not given back (see module doc)."""
    return sum(counts[k] for k in SLOT_TAKERS) - sum(counts[k] for k in SLOT_RETURNERS)


def lost_groups(counts: dict[str, int]) -> int:
    """Pushed groups that are in no outcome and not in the buffer: 0 unless a guarantee broke."""
    kept = sum(counts[k] for k in ("trained", "dropped_stale", "filtered", "dead", "queued", "pending"))
    return counts["pushed"] - (kept - counts["foreign_in_buffer"])


def unfinished_groups(counts: dict[str, int]) -> int:
    """Admitted groups neither pushed nor given back: those still being generated (0 once every
    generator has stopped, unless a crash leaked a slot). With :func:`lost_groups` this is the whole
    account of every admitted group: started = pushed + abandoned + failed + unfinished."""
    return counts["started"] - counts["pushed"] - counts["abandoned"] - counts["failed"]


def check_release_reason(reason: str) -> None:
    if reason not in RELEASE_REASONS:
        raise ValueError(f"unknown release reason {reason!r}; expected one of {RELEASE_REASONS}")


def new_token() -> str:
    """An idempotency token: one per logical request, reused by its retries."""
    return uuid.uuid4().hex


class BufferUnavailableError(ConnectionError):
    """The buffer's backing service stayed unreachable after the retries; the message names it."""


class Buffer(ABC):
    """Trajectory buffer shared by all generators and learner ranks of one run."""

    # ----- generators -------------------------------------------------------------------------

    @abstractmethod
    def try_start_group(
        self,
        serving_version: int,
        max_policy_lag: int,
        groups_per_step: int,
        token: str | None = None,
        producer: str | None = None,
    ) -> int | None:
        """Admission control, atomically.

        If :func:`live_groups` ``< admission_limit(serving_version, k, B)``, increment ``started``
        and return the 0-based sequence number of the new group; else return None and change
        nothing. ``serving_version`` is the version the CALLER's engine serves, not the learner's
        (see ``asyncrl/staleness.py``), or one it will serve before any turn of the group starts (an
        update held back until running turns finish: ``EnginePump.next_version``). Sequence numbers are
        unique and increasing. Calls with the same ``token`` (default: a new one) are one request: a
        retry returns the first answer. With a ``producer``, the admitted group is held by it (see
        :meth:`release_held`).
        """

    @abstractmethod
    def push(self, group_id: str, frame: bytes, producer: str = "unknown", seq: int | None = None) -> bool:
        """Append one encoded group; False (and no append) if ``group_id`` was pushed before.

        A retried push after a lost reply returns False although the first attempt appended, so
        False means "this group is in the buffer already", never "this group was lost".
        ``producer`` names the sender in dead letters and ``asyncrl status``; the append ends one
        of the groups it holds, and the journal of group ``seq`` if it kept one.
        """

    @abstractmethod
    def release(
        self,
        n: int = 1,
        token: str | None = None,
        reason: str = "abandoned",
        producer: str | None = None,
        seq: int | None = None,
    ) -> None:
        """``n`` admitted groups will never be pushed: give their admission slots back, counted as
        ``reason``: ``abandoned`` (a too-long prompt, shutdown, a dead generator) or ``failed`` (their
        episodes failed). Without this, every such group shrinks the admission window for the rest
        of the run. With a ``producer``, they are groups it holds; with ``seq`` (``n`` = 1), the
        journal of that group ends too. Idempotent per ``token``."""

    @abstractmethod
    def release_held(self, producer: str | None = None, *, resume: bool = False, reaped: int | None = None) -> int:
        """Give back, as ``abandoned``, the slots of every group ``producer`` holds (None: every
        producer's, and every orphan unless ``resume``), atomically: it died, or the run resumes
        without it. With ``resume``, its journaled groups become orphans instead (their slots stay
        taken) for :meth:`take_orphan`. ``reaped``: the fleet's reaper took ``producer``'s held
        count already (``RunControl.reap``), and it is this many. Returns how many were given back
        (0 on a retry whose first attempt's reply was lost: it gave them back)."""

    @abstractmethod
    def journal(self, seq: int, part: str, state: bytes, producer: str) -> bool:
        """Keep ``state`` as ``part`` of group ``seq``'s journal (replacing that part), for the group's
        producer; False, keeping nothing, if another generator took the group (it is no longer
        ``producer``'s: it stalled past its lease, its groups were orphaned)."""

    @abstractmethod
    def take_orphan(self, producer: str) -> tuple[int, dict[str, bytes]] | None:
        """The oldest orphan, now held by ``producer`` (counted ``resumed``), with its journal
        (part -> state); None when there is none."""

    @abstractmethod
    def orphans(self) -> int:
        """Orphaned groups waiting for a generator (a gauge)."""

    # ----- learner ranks ----------------------------------------------------------------------

    @abstractmethod
    def read(self, consumer: str, count: int, block_ms: int) -> list[Entry]:
        """Up to ``count`` entries never delivered before, now pending for ``consumer``.

        Blocks up to ``block_ms`` (0: do not block) when there is nothing to deliver; may return
        fewer entries, or none, earlier. Entries come in append order.
        """

    @abstractmethod
    def pending(self, consumer: str) -> list[Entry]:
        """Every entry delivered to ``consumer`` and not acknowledged, oldest first.

        A restarted learner rank calls this with its own consumer name to get back what it had
        read before the crash; a consumer whose read reply was lost finds those entries here.
        """

    @abstractmethod
    def pending_ids(self, consumer: str) -> list[str]:
        """The ids of :meth:`pending` (cheap: no frames)."""

    @abstractmethod
    def ack(self, entries: Sequence[Entry], outcome: str) -> int:
        """Acknowledge delivered entries with their ``outcome`` (a key of :data:`OUTCOMES`): they
        are done, removed from the buffer, and counted. Returns how many were acknowledged now.

        ``trained``: only after the learner checkpoint that includes their update is committed.
        ``stale`` / ``filtered``: at once; their admission slots are given back (else a learner
        that waits for fresh groups could wait forever). Unknown or already-acknowledged entries
        are ignored and not counted; a foreign one is counted as ``foreign``, not as ``outcome``.
        """

    @abstractmethod
    def dead_letter(self, entry: Entry, reason: str) -> str | None:
        """Acknowledge ``entry`` and keep its frame on the dead-letter stream with ``reason`` and
        its producer, atomically. Returns the counter it moved: ``dead`` (a pushed group: its slot
        is given back) or ``foreign``; None (nothing kept) if it was acknowledged already."""

    @abstractmethod
    def record_replays(self, n: int, token: str | None = None) -> None:
        """``n`` trainings of groups trained before (``buffer.replay_times > 1``): each takes an
        admission slot, as a new group would. Idempotent per ``token``."""

    @abstractmethod
    def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        """The most recent dead letters, oldest first (at most ``count``)."""

    # ----- versions ---------------------------------------------------------------------------

    @abstractmethod
    def set_version(self, v: int) -> None:
        """Publish the learner's policy version (rank 0, after each optimizer step)."""

    @abstractmethod
    def get_version(self) -> int:
        """The last published learner version; 0 if none was published."""

    # ----- counters ---------------------------------------------------------------------------

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """A consistent snapshot of every key in :data:`STAT_KEYS`."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the buffer's contents stay for other processes."""

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_count(name: str, n: int) -> None:
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
