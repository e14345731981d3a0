"""In-process buffer with the same semantics as the Redis one: for fast tests and one-process runs.

Concurrency: every method takes one lock, so each is atomic with respect to the others, as each
Redis command or Lua script is. :meth:`MemoryBuffer.read` waits on a condition tied to that lock.
Only threads of one process can share it.
"""

from __future__ import annotations

import collections
import threading
import time

from asyncrl.buffers.base import (
    DEAD_FRAME_MAX_BYTES,
    DEAD_MAX_ENTRIES,
    Buffer,
    DeadLetter,
    Entry,
    check_count,
)
from asyncrl.staleness import admission_limit


class _Pending:
    __slots__ = ("consumer", "frame", "delivered_at")

    def __init__(self, consumer: str, frame: bytes, delivered_at: float):
        self.consumer = consumer
        self.frame = frame
        self.delivered_at = delivered_at


class MemoryBuffer(Buffer):
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._counters = {
            k: 0 for k in ("started", "pushed", "duplicates", "dropped_stale", "abandoned", "acked", "dead")
        }
        self._seen: set[str] = set()
        self._next_id = 0
        self._queue: collections.deque[tuple[str, bytes]] = collections.deque()  # never delivered
        self._pending: dict[str, _Pending] = {}  # insertion order = delivery order
        self._dead: collections.deque[DeadLetter] = collections.deque(maxlen=DEAD_MAX_ENTRIES)
        self._version = 0

    # ----- generators -------------------------------------------------------------------------

    def try_start_group(self, serving_version: int, max_policy_lag: int, groups_per_step: int) -> int | None:
        limit = admission_limit(serving_version, max_policy_lag, groups_per_step)
        with self._cond:
            c = self._counters
            if c["started"] - c["dropped_stale"] - c["abandoned"] >= limit:
                return None
            c["started"] += 1
            return c["started"] - 1

    def push(self, group_id: str, frame: bytes) -> bool:
        with self._cond:
            if group_id in self._seen:
                self._counters["duplicates"] += 1
                return False
            self._seen.add(group_id)
            self._next_id += 1
            self._queue.append((f"{self._next_id}-0", bytes(frame)))
            self._counters["pushed"] += 1
            self._cond.notify_all()
            return True

    def release(self, n: int = 1) -> None:
        check_count("n", n)
        with self._cond:
            self._counters["abandoned"] += n

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
            now = time.monotonic()
            while self._queue and len(out) < count:
                entry_id, frame = self._queue.popleft()
                self._pending[entry_id] = _Pending(consumer, frame, now)
                out.append(Entry(entry_id, frame))
            return out

    def reclaim(self, consumer: str, min_idle_ms: int, count: int) -> list[Entry]:
        check_count("count", count)
        now = time.monotonic()
        with self._cond:
            out = []
            for entry_id, p in self._pending.items():
                if len(out) >= count:
                    break
                if (now - p.delivered_at) * 1000 >= min_idle_ms:
                    p.consumer, p.delivered_at = consumer, now
                    out.append(Entry(entry_id, p.frame))
            return out

    def ack(self, entry_ids: list[str]) -> None:
        with self._cond:
            for entry_id in entry_ids:
                if self._pending.pop(entry_id, None) is not None:
                    self._counters["acked"] += 1

    def record_dropped(self, n: int) -> None:
        check_count("n", n)
        with self._cond:
            self._counters["dropped_stale"] += n

    def dead_letter(self, frame: bytes, reason: str, producer: str) -> None:
        letter = DeadLetter(str(reason), str(producer), len(frame), bytes(frame[:DEAD_FRAME_MAX_BYTES]))
        with self._cond:
            self._dead.append(letter)
            self._counters["dead"] += 1

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
            return {**self._counters, "queued": len(self._queue), "pending": len(self._pending)}

    def close(self) -> None:
        pass
