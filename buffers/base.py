"""The trajectory buffer between generators and learner ranks: interface and shared types.

Who calls what:

* generators: :meth:`Buffer.try_start_group` before generating a group (admission control), then
  :meth:`Buffer.push` with the encoded group, or :meth:`Buffer.release` if the group is abandoned;
* learner ranks: :meth:`Buffer.read` (each entry is delivered to exactly one consumer), then
  :meth:`Buffer.ack` once the checkpoint that consumed the entries is committed;
  :meth:`Buffer.record_dropped` for stale groups, :meth:`Buffer.dead_letter` for bad frames;
* learner rank 0: :meth:`Buffer.set_version` after each optimizer step.

Invariants every implementation keeps, under any number of concurrent callers (threads for the
memory buffer; threads and processes for Redis):

* **admission bound**: ``started - dropped_stale - abandoned`` never exceeds
  :func:`asyncrl.staleness.admission_limit` of the largest ``serving_version`` any caller passed.
  The check and the increment are one atomic step, so racing generators cannot overshoot.
* **at most one append per group id**: a second push of the same id is a no-op that returns False.
* **exactly-one delivery**: an entry returned by :meth:`read` to one consumer is never returned by
  :meth:`read` to another; it stays *pending* until acknowledged and can be taken over with
  :meth:`reclaim` when its consumer died.
* counters only grow (except ``queued``/``pending``, which are gauges).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod

# Counters every implementation reports from :meth:`Buffer.stats` (``queued``/``pending`` are gauges).
STAT_KEYS = (
    "started",  # groups admitted by try_start_group
    "pushed",  # distinct groups appended
    "duplicates",  # pushes ignored because the group id was seen before
    "dropped_stale",  # consumed groups dropped as too stale (their admission slots were given back)
    "abandoned",  # admitted groups that will never be pushed (their slots were given back)
    "acked",  # entries acknowledged (and removed from the stream)
    "dead",  # frames sent to the dead-letter stream
    "queued",  # entries appended but not yet delivered to any consumer
    "pending",  # entries delivered but not yet acknowledged
)

# Dead letters keep at most this much of the offending frame: enough to debug, and an oversize
# frame (one of the reasons to dead-letter) must not blow up the buffer's memory a second time.
DEAD_FRAME_MAX_BYTES = 1 << 20
# The dead-letter stream keeps about this many recent entries; the `dead` counter counts all.
DEAD_MAX_ENTRIES = 1000


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One trajectory group as delivered to a learner rank."""

    entry_id: str  # buffer-assigned, increasing in append order (a Redis stream id like "17-0")
    frame: bytes  # the msgpack frame as pushed (see asyncrl.protocol)


@dataclasses.dataclass(frozen=True, slots=True)
class DeadLetter:
    """A frame a learner could not use, with why and who sent it."""

    reason: str
    producer: str
    size: int  # size of the original frame in bytes
    frame: bytes  # the first DEAD_FRAME_MAX_BYTES of the frame


class BufferUnavailableError(ConnectionError):
    """The buffer's backing service stayed unreachable after the retries; the message names it."""


class Buffer(ABC):
    """Trajectory buffer shared by all generators and learner ranks of one run."""

    # ----- generators -------------------------------------------------------------------------

    @abstractmethod
    def try_start_group(self, serving_version: int, max_policy_lag: int, groups_per_step: int) -> int | None:
        """Admission control, atomically.

        If ``started - dropped_stale - abandoned < admission_limit(serving_version, k, B)``, increment
        ``started`` and return the 0-based sequence number of the new group; else return None and
        change nothing. ``serving_version`` is the version the CALLER's engine serves, not the
        learner's (see ``asyncrl/staleness.py``). Sequence numbers are unique and increasing.
        """

    @abstractmethod
    def push(self, group_id: str, frame: bytes) -> bool:
        """Append one encoded group; False (and no append) if ``group_id`` was pushed before.

        A retried push after a lost reply returns False although the first attempt appended, so
        False means "this group is in the buffer already", never "this group was lost".
        """

    @abstractmethod
    def release(self, n: int = 1) -> None:
        """``n`` admitted groups will never be pushed (failed generation, shutdown): give their
        admission slots back, counted as ``abandoned``. Without this, every abandoned group shrinks
        the admission window for the rest of the run."""

    # ----- learner ranks ----------------------------------------------------------------------

    @abstractmethod
    def read(self, consumer: str, count: int, block_ms: int) -> list[Entry]:
        """Up to ``count`` entries never delivered before, now pending for ``consumer``.

        Blocks up to ``block_ms`` (0: do not block) when there is nothing to deliver; may return
        fewer entries, or none, earlier. Entries come in append order.
        """

    @abstractmethod
    def reclaim(self, consumer: str, min_idle_ms: int, count: int) -> list[Entry]:
        """Take over up to ``count`` pending entries idle for at least ``min_idle_ms`` (from any
        consumer, ``consumer`` itself included) and deliver them again to ``consumer``.

        A restarted learner rank calls this (``min_idle_ms=0`` for its own entries) so that entries
        delivered but not acknowledged before a crash are trained on, not lost.
        """

    @abstractmethod
    def ack(self, entry_ids: list[str]) -> None:
        """Acknowledge delivered entries: they are done and removed from the buffer for good.

        Call only after the learner checkpoint that consumed them is committed. Unknown or
        already-acknowledged ids are ignored.
        """

    @abstractmethod
    def record_dropped(self, n: int) -> None:
        """``n`` consumed groups were stale and dropped: counted as ``dropped_stale``, and their
        admission slots given back (else a learner that needs fresh groups could wait forever)."""

    @abstractmethod
    def dead_letter(self, frame: bytes, reason: str, producer: str) -> None:
        """Keep a bad frame on the dead-letter stream with ``reason`` and ``producer``; counted as
        ``dead``. The caller still acknowledges the entry the frame came in."""

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
