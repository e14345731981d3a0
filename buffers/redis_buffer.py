"""The buffer on a real Redis server, shared by any number of generator and learner processes.

Key layout (``P`` is the run's prefix, e.g. ``asyncrl:{demo}:``; the ``{...}`` hash tag puts every
key of a run in one Redis Cluster slot, which multi-key Lua scripts need):

=================  =======  ==========================================================================
key                type     contents
=================  =======  ==========================================================================
``P traj``         stream   one entry per group: ``gid`` (group id), ``frame`` (msgpack bytes);
                            consumer group ``learners``, one consumer per learner rank
``P dead``         stream   ``reason``, ``producer``, ``size``, ``frame`` (first 1 MiB); ~1000 kept
``P counters``     hash     started, pushed, duplicates, dropped_stale, abandoned, acked, dead
``P seen``         set      every group id ever pushed (duplicate detection)
``P version``      string   the learner's policy version (absent: 0)
=================  =======  ==========================================================================

Atomicity: admission (compare and increment) and push (dedup and append and count) are Lua
scripts, ack (XACK, then XDEL of exactly the acknowledged ids, and count) is one too; Redis runs a
script without interleaving any other command, so racing processes cannot pass the admission bound
or append a group twice. Acknowledged entries are deleted, so the stream holds only queued and
pending (delivered, not yet acknowledged) entries: memory is bounded by the admission window plus
whatever learners have read but not acknowledged yet.

Failures: every method is retried with jittered exponential back-off on connection errors and
timeouts (a restarting server is ridden through); after the last retry a
:class:`BufferUnavailableError` names the server (never the password).
"""

from __future__ import annotations

import functools
import random
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncrl.buffers.base import (
    DEAD_FRAME_MAX_BYTES,
    DEAD_MAX_ENTRIES,
    Buffer,
    BufferUnavailableError,
    DeadLetter,
    Entry,
    check_count,
)
from asyncrl.errors import UserError
from asyncrl.redis_server import url_address
from asyncrl.staleness import admission_limit

GROUP = "learners"
_COUNTERS = ("started", "pushed", "duplicates", "dropped_stale", "abandoned", "acked", "dead")
# Reads block at most this long per call. It must stay below the socket timeout, or a long block
# would look like a dead connection; callers loop anyway.
_MAX_BLOCK_MS = 20_000
_SOCKET_TIMEOUT_S = 30.0

# KEYS: counters. ARGV: limit. Returns the new group's sequence number, or -1 when refused.
_ADMIT = """
local c = redis.call('HMGET', KEYS[1], 'started', 'dropped_stale', 'abandoned')
local started = tonumber(c[1]) or 0
local live = started - (tonumber(c[2]) or 0) - (tonumber(c[3]) or 0)
if live >= tonumber(ARGV[1]) then return -1 end
redis.call('HINCRBY', KEYS[1], 'started', 1)
return started
"""

# KEYS: seen, traj, counters. ARGV: group id, frame. Returns 1 if appended, 0 for a duplicate.
_PUSH = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then
  redis.call('HINCRBY', KEYS[3], 'duplicates', 1)
  return 0
end
redis.call('XADD', KEYS[2], '*', 'gid', ARGV[1], 'frame', ARGV[2])
redis.call('HINCRBY', KEYS[3], 'pushed', 1)
return 1
"""

# KEYS: traj, counters. ARGV: consumer group, entry ids... Deletes only what XACK acknowledged, so an
# id that was never delivered (or is unknown) cannot make a queued entry disappear.
_ACK = """
local n = 0
for i = 2, #ARGV do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    redis.call('XDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[2], 'acked', n) end
return n
"""


def backoff_s(attempt: int, base_s: float, cap_s: float) -> float:
    """Sleep before retry number ``attempt`` (1, 2, ...): "equal jitter" exponential back-off.

    Half of ``min(cap, base * 2**attempt)`` is fixed, so the retries together always wait at least
    about half their nominal sum (0.1 s base, 2 s cap, 6 retries: 3.5 to 7 s, which rides through a
    server restart); the random half keeps many clients from reconnecting in lockstep.
    """
    t = min(cap_s, base_s * 2**attempt) / 2
    return t + random.uniform(0, t)


def _retrying(method):
    """Retry on connection errors and timeouts with back-off; then one clear error naming the server.

    The retry wraps the whole method: a Lua script whose first run completed but whose reply was
    lost runs again (push: then reports a duplicate; admission: a slot is used twice, see release).
    """

    @functools.wraps(method)
    def wrapper(self: RedisBuffer, *args, **kwargs):
        for attempt in range(1, self.retries + 2):
            try:
                return method(self, *args, **kwargs)
            except redis.AuthenticationError:
                raise  # a subclass of ConnectionError, but waiting will not fix a wrong password
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if attempt > self.retries:
                    raise BufferUnavailableError(
                        f"Redis buffer at {self.address} unreachable after {self.retries} retries: {exc}"
                    ) from exc
                time.sleep(backoff_s(attempt, self._backoff_base_s, self._backoff_cap_s))
        raise AssertionError("unreachable")

    return wrapper


class RedisBuffer(Buffer):
    """Construct one per process (or share one between threads: redis-py's pool is thread-safe)."""

    def __init__(
        self,
        url: str,
        prefix: str,
        *,
        retries: int = 6,
        backoff_base_s: float = 0.1,
        backoff_cap_s: float = 2.0,
    ):
        self.address = url_address(url)
        self.retries = retries
        self._backoff_base_s, self._backoff_cap_s = backoff_base_s, backoff_cap_s
        self.prefix = prefix if prefix.endswith(":") else prefix + ":"
        self._r = redis.Redis.from_url(
            url,
            decode_responses=False,
            # redis-py's own retries nest (connect inside command), so they are off; _retrying retries.
            retry=Retry(NoBackoff(), 0),
            socket_connect_timeout=5.0,
            socket_timeout=_SOCKET_TIMEOUT_S,
            health_check_interval=30,
        )
        self._k_traj = self._key("traj")
        self._k_dead = self._key("dead")
        self._k_counters = self._key("counters")
        self._k_seen = self._key("seen")
        self._k_version = self._key("version")
        self._admit = self._r.register_script(_ADMIT)
        self._push = self._r.register_script(_PUSH)
        self._ack = self._r.register_script(_ACK)
        try:
            self._ensure_group()
        except redis.AuthenticationError as exc:
            self._r.close()
            raise UserError(f"Redis at {self.address} refused the credentials: {exc}") from None

    def _key(self, name: str) -> str:
        return self.prefix + name

    @_retrying
    def _ensure_group(self) -> None:
        """Create the stream and its consumer group if missing (idempotent, any process may race)."""
        try:
            self._r.xgroup_create(self._k_traj, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # ----- generators -------------------------------------------------------------------------

    @_retrying
    def try_start_group(self, serving_version: int, max_policy_lag: int, groups_per_step: int) -> int | None:
        limit = admission_limit(serving_version, max_policy_lag, groups_per_step)
        seq = int(self._admit(keys=[self._k_counters], args=[limit]))
        return None if seq < 0 else seq

    @_retrying
    def push(self, group_id: str, frame: bytes) -> bool:
        return bool(self._push(keys=[self._k_seen, self._k_traj, self._k_counters], args=[group_id, frame]))

    @_retrying
    def release(self, n: int = 1) -> None:
        check_count("n", n)
        if n:
            self._r.hincrby(self._k_counters, "abandoned", n)

    # ----- learner ranks ----------------------------------------------------------------------

    @_retrying
    def read(self, consumer: str, count: int, block_ms: int) -> list[Entry]:
        check_count("count", count)
        if count == 0:
            return []
        block = min(block_ms, _MAX_BLOCK_MS) if block_ms > 0 else None
        try:
            reply = self._read(consumer, count, block)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._ensure_group()  # the server lost its data (no persistence) or someone deleted it
            reply = self._read(consumer, count, block)
        return [_entry(eid, fields) for _, entries in reply or [] for eid, fields in entries if fields]

    def _read(self, consumer: str, count: int, block: int | None):
        return self._r.xreadgroup(GROUP, consumer, {self._k_traj: ">"}, count=count, block=block)

    @_retrying
    def reclaim(self, consumer: str, min_idle_ms: int, count: int) -> list[Entry]:
        check_count("count", count)
        out: list[Entry] = []
        start = "0-0"
        while len(out) < count:
            reply = self._r.xautoclaim(
                self._k_traj, GROUP, consumer, min_idle_ms, start_id=start, count=count - len(out)
            )
            start, claimed = reply[0], reply[1]
            out.extend(_entry(eid, fields) for eid, fields in claimed if fields)
            if start in (b"0-0", "0-0"):
                break
        return out

    @_retrying
    def ack(self, entry_ids: list[str]) -> None:
        if entry_ids:
            self._ack(keys=[self._k_traj, self._k_counters], args=[GROUP, *entry_ids])

    @_retrying
    def record_dropped(self, n: int) -> None:
        check_count("n", n)
        if n:
            self._r.hincrby(self._k_counters, "dropped_stale", n)

    @_retrying
    def dead_letter(self, frame: bytes, reason: str, producer: str) -> None:
        fields = {
            "reason": str(reason),
            "producer": str(producer),
            "size": len(frame),
            "frame": bytes(frame[:DEAD_FRAME_MAX_BYTES]),
        }
        pipe = self._r.pipeline(transaction=True)
        pipe.xadd(self._k_dead, fields, maxlen=DEAD_MAX_ENTRIES, approximate=True)
        pipe.hincrby(self._k_counters, "dead", 1)
        pipe.execute()

    @_retrying
    def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        check_count("count", count)
        if count == 0:
            return []
        rows = self._r.xrevrange(self._k_dead, count=count)
        return [
            DeadLetter(
                reason=f[b"reason"].decode(errors="replace"),
                producer=f[b"producer"].decode(errors="replace"),
                size=int(f[b"size"]),
                frame=f[b"frame"],
            )
            for _, f in reversed(rows)
        ]

    # ----- versions and counters --------------------------------------------------------------

    @_retrying
    def set_version(self, v: int) -> None:
        self._r.set(self._k_version, int(v))

    @_retrying
    def get_version(self) -> int:
        raw = self._r.get(self._k_version)
        return int(raw) if raw is not None else 0

    @_retrying
    def stats(self) -> dict[str, int]:
        pipe = self._r.pipeline(transaction=True)  # MULTI/EXEC: one consistent snapshot
        pipe.hgetall(self._k_counters)
        pipe.xlen(self._k_traj)
        pipe.xpending(self._k_traj, GROUP)
        counters, length, pending = pipe.execute()
        out = {k: int(counters.get(k.encode(), 0)) for k in _COUNTERS}
        out["pending"] = int(pending["pending"])
        # Acknowledged entries are deleted, so the stream holds exactly the queued + pending ones.
        out["queued"] = int(length) - out["pending"]
        return out

    def close(self) -> None:
        self._r.close()


def _entry(entry_id: bytes | str, fields: dict) -> Entry:
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return Entry(eid, fields[b"frame"])
