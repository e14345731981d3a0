"""In-process buffer with the same semantics as the Redis one: for fast tests and one-process runs.

Concurrency: every method takes one lock, so each is atomic with respect to the others, as each
Redis command or Lua script is. :meth:`MemoryBuffer.read` waits on a condition tied to that lock.
Only threads of one process can share it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence

from asyncrl.buffers.base import (
    CLAIM_PART,
    COUNTER_KEYS,
    DEAD_FRAME_MAX_BYTES,
    DEAD_MAX_ENTRIES,
    OUTCOMES,
    SEEN_WINDOW,
    Buffer,
    DeadLetter,
    Entry,
    check_count,
    check_release_reason,
    live_groups,
)
from asyncrl.staleness import may_start_group


class _Pending:
    __slots__ = ("consumer", "entry")

    def __init__(self, consumer: str, entry: Entry):
        self.consumer = consumer
        self.entry = entry


class MemoryBuffer(Buffer):
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._counters = dict.fromkeys(COUNTER_KEYS, 0)
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()  # newest SEEN_WINDOW ids
        self._once: dict[str, int] = {}  # idempotency token -> first answer
        self._next_id = 0
        self._queue: collections.deque[Entry] = collections.deque()  # never delivered
        self._pending: dict[str, _Pending] = {}  # insertion order = delivery order
        self._dead: collections.deque[DeadLetter] = collections.deque(maxlen=DEAD_MAX_ENTRIES)
        self._version = 0
        self._held: collections.Counter[str] = collections.Counter()  # producer -> groups it holds
        self._journals: dict[int, tuple[str, dict[str, bytes]]] = {}  # seq -> (owner, '' for an orphan; parts)
        self._orphans: collections.deque[int] = collections.deque()

    # ----- generators -------------------------------------------------------------------------

    def try_start_group(
        self,
        serving_version: int,
        max_policy_lag: int,
        groups_per_step: int,
        token: str | None = None,
        producer: str | None = None,
    ) -> int | None:
        with self._cond:
            if token is not None and token in self._once:
                seq = self._once[token]
            elif not may_start_group(serving_version, live_groups(self._counters), max_policy_lag, groups_per_step):
                seq = -1
            else:
                seq = self._counters["started"]
                self._counters["started"] += 1
                if producer is not None:  # held, and its claim journaled (base.CLAIM_PART)
                    self._held[producer] += 1
                    self._journals[seq] = (producer, {CLAIM_PART: b"{}"})
            if token is not None:
                self._once[token] = seq
            return None if seq < 0 else seq

    def push(self, group_id: str, frame: bytes, producer: str = "unknown", seq: int | None = None) -> bool:
        with self._cond:
            self._journals.pop(seq, None)
            if group_id in self._seen:
                self._counters["duplicates"] += 1
                return False
            self._seen[group_id] = None
            if len(self._seen) > SEEN_WINDOW:
                self._seen.popitem(last=False)
            self._next_id += 1
            self._queue.append(Entry(f"{self._next_id}-0", bytes(frame), str(producer), str(group_id)))
            self._counters["pushed"] += 1
            self._unhold(str(producer), 1)
            self._cond.notify_all()
            return True

    def release(
        self,
        n: int = 1,
        token: str | None = None,
        reason: str = "abandoned",
        producer: str | None = None,
        seq: int | None = None,
    ) -> None:
        check_release_reason(reason)
        with self._cond:
            self._journals.pop(seq, None)
        self._count_once(reason, n, token, producer)

    def release_held(self, producer: str | None = None, *, resume: bool = False, reaped: int | None = None) -> int:
        with self._cond:
            if reaped is not None:
                n = reaped
            else:
                producers = list(self._held) if producer is None else [producer]
                n = sum(self._held.pop(p, 0) for p in producers)
            for seq, (owner, parts) in list(self._journals.items()):
                if owner == "":
                    if producer is None and not resume:  # nobody will resume it
                        del self._journals[seq]
                        n += 1
                elif producer is None or owner == producer:
                    if resume and n > 0:
                        self._journals[seq] = ("", parts)
                        self._orphans.append(seq)
                        n -= 1
                    else:
                        del self._journals[seq]
            self._counters["abandoned"] += n
            return n

    def journal(self, seq: int, part: str, state: bytes, producer: str) -> bool:
        with self._cond:
            owner, parts = self._journals.get(seq, (producer, {}))
            if owner != producer:
                return False
            parts[str(part)] = bytes(state)
            self._journals[seq] = (owner, parts)
            return True

    def take_orphan(self, producer: str) -> tuple[int, dict[str, bytes]] | None:
        with self._cond:
            while self._orphans:
                seq = self._orphans.popleft()
                owner, parts = self._journals.get(seq, (None, {}))
                if owner == "":
                    self._journals[seq] = (producer, parts)
                    self._held[producer] += 1
                    self._counters["resumed"] += 1
                    return seq, dict(parts)
            return None

    def orphans(self) -> int:
        with self._cond:
            return sum(owner == "" for owner, _ in self._journals.values())

    def record_replays(self, n: int, token: str | None = None) -> None:
        self._count_once("replayed", n, token)

    def _count_once(self, field: str, n: int, token: str | None, producer: str | None = None) -> None:
        check_count("n", n)
        with self._cond:
            if token is not None:
                if token in self._once:
                    return
                self._once[token] = n
            self._counters[field] += n
            if producer is not None:
                self._unhold(producer, n)

    def _unhold(self, producer: str, n: int) -> None:
        """``producer`` holds ``n`` fewer groups (never below none: a reaped one's were taken)."""
        left = self._held[producer] - n
        if left > 0:
            self._held[producer] = left
        else:
            self._held.pop(producer, None)

    # ----- learner ranks ----------------------------------------------------------------------

    def read(self, consumer: str, count: int, block_ms: int) -> list[Entry]:
        check_count("count", count)
        deadline = time.monotonic() + max(block_ms, 0) / 1000
        with self._cond:
            while not self._queue:
                left = deadline - time.monotonic()
                if left <= 0 or count == 0:
                    return []
                self._cond.wait(left)
            out = []
            while self._queue and len(out) < count:
                entry = self._queue.popleft()
                self._pending[entry.entry_id] = _Pending(consumer, entry)
                out.append(entry)
            return out

    def pending(self, consumer: str) -> list[Entry]:
        with self._cond:
            return [p.entry for p in self._pending.values() if p.consumer == consumer]

    def pending_ids(self, consumer: str) -> list[str]:
        return [e.entry_id for e in self.pending(consumer)]

    def ack(self, entries: Sequence[Entry], outcome: str) -> int:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {sorted(OUTCOMES)}")
        with self._cond:
            n = sum(self._pending.pop(e.entry_id, None) is not None for e in entries)
            self._counters[OUTCOMES[outcome]] += n
            return n

    def dead_letter(self, entry: Entry, reason: str) -> str | None:
        frame = entry.frame
        letter = DeadLetter(str(reason), entry.producer, len(frame), bytes(frame[:DEAD_FRAME_MAX_BYTES]))
        with self._cond:
            if self._pending.pop(entry.entry_id, None) is None:
                return None
            self._dead.append(letter)
            self._counters["dead"] += 1  # only push() appends here: nothing in memory is foreign
            return "dead"

    def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        check_count("count", count)
        with self._cond:
            return list(self._dead)[-count:] if count else []

    # ----- versions and counters --------------------------------------------------------------

    def set_version(self, v: int) -> None:
        with self._cond:
            self._version = int(v)

    def get_version(self) -> int:
        with self._cond:
            return self._version

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {**self._counters, "queued": len(self._queue), "pending": len(self._pending), "foreign_in_buffer": 0}

    def close(self) -> None:
        pass
