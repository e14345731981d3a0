"""The buffer on a real Redis server, shared by any number of generator and learner processes.

Keys (``traj``, ``dead``, ``counters``, ``seen``, ``once:<token>``, ``version`` under the run's prefix)
are listed with every other key of a run in ``asyncrl.keys``.

Atomicity: admission (compare and increment), acknowledgement (XACK, XDEL of exactly the
acknowledged ids, count the outcome) and dead letters (the same plus the dead-letter append) are Lua
scripts; push (append, dedup, count) is a MULTI/EXEC transaction of a plain XADD and a Lua script
that takes the entry out again if the id was seen. Redis runs a script or a transaction without
interleaving any other command, so racing processes cannot pass the admission bound, append a group
twice, or count an outcome twice. Frames never pass through Lua on the way in: copying a 100 KB
argument into Lua cost more server CPU than the XADD itself (``scripts/bench/buffer.py``).
Acknowledged entries are deleted, so the stream holds only queued and pending entries: memory is
bounded by the admission window plus whatever learners have read but not acknowledged.

Durability: the launcher's redis-server appends every write to its AOF and fsyncs it before it
replies (``appendfsync always``, see ``asyncrl/fleet/redis_server.py``), so a
killed server restarts with every group a generator saw acknowledged, the consumer group's pending
lists, and the counters. Script effects are what the AOF records, and a transaction is one
MULTI/EXEC block in it (a block cut short by a crash is dropped on load), so a restart replays them
exactly.

Failures: every method is retried with jittered exponential back-off on connection errors and
timeouts (a restarting server is ridden through); after the last retry a
:class:`BufferUnavailableError` names the server (never the password).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncrl.buffers.base import (
    COUNTER_KEYS,
    DEAD_FRAME_MAX_BYTES,
    DEAD_MAX_ENTRIES,
    IDEMPOTENCY_TTL_S,
    OUTCOMES,
    SEEN_WINDOW,
    SLOT_RETURNERS,
    SLOT_TAKERS,
    Buffer,
    BufferUnavailableError,
    DeadLetter,
    Entry,
    check_count,
    check_release_reason,
    new_token,
)
from asyncrl.errors import UserError
from asyncrl.keys import RunKeys
from asyncrl.net import backoff_s, url_address
from asyncrl.staleness import admission_limit

GROUP = "learners"
# Reads block at most this long per call. It must stay below the socket timeout, or a long block
# would look like a dead connection; callers loop anyway.
_MAX_BLOCK_MS = 20_000
_SOCKET_TIMEOUT_S = 30.0
ADMISSION_RECORDS = 200_000  # about this many of the newest admissions are kept (a few MB)

# KEYS: counters, once-token, admissions, held. ARGV: limit, ttl, records kept, producer ('' for
# none: nobody holds the group). Returns the new group's sequence number, or -1 when refused; a retry
# with the same token returns the first answer without counting again. ``live`` is
# base.live_groups, spelled in Lua from the same SLOT_TAKERS / SLOT_RETURNERS tuples. Every admission
# is recorded (its sequence number, the groups holding a slot after it, and the limit it was judged
# against), so a run's history can be checked afterwards.
_ADMIT = """
local prev = redis.call('GET', KEYS[2])
if prev then return tonumber(prev) end
local takers = redis.call('HMGET', KEYS[1], {takers})
local returners = redis.call('HMGET', KEYS[1], {returners})
local live = 0
for _, v in ipairs(takers) do live = live + (tonumber(v) or 0) end
for _, v in ipairs(returners) do live = live - (tonumber(v) or 0) end
local seq = -1
if live < tonumber(ARGV[1]) then
  seq = tonumber(redis.call('HGET', KEYS[1], 'started')) or 0
  redis.call('HINCRBY', KEYS[1], 'started', 1)
  if ARGV[4] ~= '' then redis.call('HINCRBY', KEYS[4], ARGV[4], 1) end
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'seq', seq, 'live', live + 1, 'limit', ARGV[1])
end
redis.call('SET', KEYS[2], seq, 'EX', ARGV[2])
return seq
""".format(
    takers=", ".join(f"'{k}'" for k in SLOT_TAKERS),
    returners=", ".join(f"'{k}'" for k in SLOT_RETURNERS),
)

# Lua: the producer ARGV[i] holds n fewer groups in KEYS[k] (never below none: a reaped one's were taken).
_UNHOLD = """
local function unhold(key, producer, n)
  local left = (tonumber(redis.call('HGET', key, producer)) or 0) - n
  if left > 0 then redis.call('HSET', key, producer, left) else redis.call('HDEL', key, producer) end
end
"""

# KEYS: counters, once-token, held. ARGV: field, n, ttl, producer ('' for none). Adds n to a counter
# once per token; the producer's n groups are no longer held.
_INCR_ONCE = f"""{_UNHOLD}
if redis.call('SET', KEYS[2], 1, 'NX', 'EX', ARGV[3]) then
  redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
  if ARGV[4] ~= '' then unhold(KEYS[3], ARGV[4], tonumber(ARGV[2])) end
end
return 0
"""

# KEYS: counters, held. ARGV: producer ('' for every producer). Counts the groups held as abandoned
# and holds none; returns how many.
_RELEASE_HELD = """
local n = 0
if ARGV[1] == '' then
  local all = redis.call('HGETALL', KEYS[2])
  for i = 2, #all, 2 do n = n + tonumber(all[i]) end
  redis.call('DEL', KEYS[2])
else
  n = tonumber(redis.call('HGET', KEYS[2], ARGV[1])) or 0
  redis.call('HDEL', KEYS[2], ARGV[1])
end
if n > 0 then redis.call('HINCRBY', KEYS[1], 'abandoned', n) end
return n
"""

# KEYS: seen, traj, counters, unacked, held. ARGV: group id, seen window, producer. Runs in one
# MULTI/EXEC right after the XADD of the group, so the newest entry of traj is that XADD's: 1 if it
# stays (counted, its group id marked unacked: that is what tells it from a foreign entry, and no
# longer held by its producer), 0 if the id is a duplicate
# and the entry is deleted again (only then is the frame copied into Lua). Refuses before changing
# anything if traj is not a stream (the XADD failed with WRONGTYPE). The seen set keeps the newest ids
# only (scored by the pushed counter).
_PUSH = f"""{_UNHOLD}
if redis.call('TYPE', KEYS[2]).ok ~= 'stream' then return redis.error_reply('ERR traj is not a stream') end
local order = (tonumber(redis.call('HGET', KEYS[3], 'pushed')) or 0) + 1
if redis.call('ZADD', KEYS[1], 'NX', order, ARGV[1]) == 0 then
  local newest = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
  redis.call('XDEL', KEYS[2], newest[1])
  redis.call('HINCRBY', KEYS[3], 'duplicates', 1)
  return 0
end
redis.call('HINCRBY', KEYS[3], 'pushed', 1)
redis.call('HSET', KEYS[4], ARGV[1], 1)
unhold(KEYS[5], ARGV[3], 1)
local excess = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[2])
if excess > 0 then redis.call('ZREMRANGEBYRANK', KEYS[1], 0, excess - 1) end
return 1
"""

# KEYS: unacked. ARGV: (entry id, group id) pairs of entries just delivered. The first entry
# delivered with a pushed group id claims it (push() appended the real one before any copy could
# follow it in the stream); returns 1 per entry that holds its group id's claim, 0 for a foreign one.
# Idempotent: an entry delivered again (a restarted consumer's pending entries) keeps its claim.
_CLAIM = """
local out = {}
for i = 1, #ARGV, 2 do
  local mark = redis.call('HGET', KEYS[1], ARGV[i + 1])
  if mark == '1' then
    redis.call('HSET', KEYS[1], ARGV[i + 1], ARGV[i])
    mark = ARGV[i]
  end
  out[#out + 1] = (mark == ARGV[i]) and 1 or 0
end
return out
"""

# KEYS: traj, counters, unacked. ARGV: consumer group, counter, then (entry id, group id) pairs.
# Deletes only what XACK acknowledged, so an id that was never delivered (or is unknown) cannot make
# a queued entry disappear, and an acknowledgement retried after a lost reply counts nothing twice.
# An entry counts as ``counter`` only if it holds its group id's claim (_CLAIM); otherwise it is
# foreign. Returns the entries counted as ``counter``.
_ACK = """
local n, foreign = 0, 0
for i = 3, #ARGV, 2 do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    redis.call('XDEL', KEYS[1], ARGV[i])
    if redis.call('HGET', KEYS[3], ARGV[i + 1]) == ARGV[i] then
      redis.call('HDEL', KEYS[3], ARGV[i + 1])
      n = n + 1
    else
      foreign = foreign + 1
    end
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[2], ARGV[2], n) end
if foreign > 0 then redis.call('HINCRBY', KEYS[2], 'foreign', foreign) end
return n
"""

# KEYS: traj, counters, dead, unacked. ARGV: consumer group, entry id, group id, reason, producer,
# size, frame head, dead-letter cap. Acknowledges the entry and keeps the letter; returns 1 (counted
# dead), 2 (foreign) or 0 (acknowledged already: nothing done).
_DEAD = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
local outcome = 2
if redis.call('HGET', KEYS[4], ARGV[3]) == ARGV[2] then
  redis.call('HDEL', KEYS[4], ARGV[3])
  outcome = 1
end
redis.call('HINCRBY', KEYS[2], outcome == 1 and 'dead' or 'foreign', 1)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[8], '*',
  'reason', ARGV[4], 'producer', ARGV[5], 'size', ARGV[6], 'frame', ARGV[7])
return outcome
"""


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
        retries: int = 10,
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
            socket_connect_timeout=2.0,
            socket_timeout=_SOCKET_TIMEOUT_S,
            health_check_interval=30,
        )
        self.keys = RunKeys(self.prefix)
        self._admit = self._r.register_script(_ADMIT)
        self._ack = self._r.register_script(_ACK)
        self._claim = self._r.register_script(_CLAIM)
        self._dead = self._r.register_script(_DEAD)
        self._incr_once = self._r.register_script(_INCR_ONCE)
        self._release_held = self._r.register_script(_RELEASE_HELD)
        try:
            self._ensure_group()
        except redis.AuthenticationError as exc:
            self._r.close()
            raise UserError(f"Redis at {self.address} refused the credentials: {exc}") from None

    @_retrying
    def _ensure_group(self) -> None:
        """Create the stream and its consumer group if missing (idempotent, any process may race)."""
        try:
            self._r.xgroup_create(self.keys.traj, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # ----- generators -------------------------------------------------------------------------

    def try_start_group(
        self,
        serving_version: int,
        max_policy_lag: int,
        groups_per_step: int,
        token: str | None = None,
        producer: str | None = None,
    ) -> int | None:
        limit = admission_limit(serving_version, max_policy_lag, groups_per_step)
        seq = self._admit_once(token or new_token(), limit, producer or "")
        return None if seq < 0 else seq

    @_retrying
    def _admit_once(self, token: str, limit: int, producer: str) -> int:
        keys = [self.keys.counters, self.keys.once(token), self.keys.admissions, self.keys.held]
        return int(self._admit(keys=keys, args=[limit, IDEMPOTENCY_TTL_S, ADMISSION_RECORDS, producer]))

    def admissions(self, after: str = "-", count: int = 10_000) -> list[tuple[int, int, int]]:
        """The admission records (oldest first, up to ``count``): (sequence, live groups after, limit)."""
        rows = self._r.xrange(self.keys.admissions, min=after, count=count)
        return [(int(f[b"seq"]), int(f[b"live"]), int(f[b"limit"])) for _, f in rows]

    @_retrying
    def push(self, group_id: str, frame: bytes, producer: str = "unknown") -> bool:
        pipe = self._r.pipeline(transaction=True)  # MULTI/EXEC, one round trip
        pipe.xadd(self.keys.traj, {"gid": group_id, "producer": producer, "frame": frame})
        # EVAL, not EVALSHA: after a server restart EVALSHA would fail with NOSCRIPT inside EXEC,
        # after the XADD had run. The script body costs ~1 KB per push next to a ~100 KB frame.
        keys = (self.keys.seen, self.keys.traj, self.keys.counters, self.keys.unacked, self.keys.held)
        pipe.eval(_PUSH, len(keys), *keys, group_id, SEEN_WINDOW, producer)
        return bool(pipe.execute()[1])

    def release(
        self, n: int = 1, token: str | None = None, reason: str = "abandoned", producer: str | None = None
    ) -> None:
        check_release_reason(reason)
        check_count("n", n)
        if n:
            self._count_once(reason, n, token or new_token(), producer or "")

    @_retrying
    def release_held(self, producer: str | None = None) -> int:
        return int(self._release_held(keys=[self.keys.counters, self.keys.held], args=[producer or ""]))

    def record_replays(self, n: int, token: str | None = None) -> None:
        check_count("n", n)
        if n:
            self._count_once("replayed", n, token or new_token())

    @_retrying
    def _count_once(self, field: str, n: int, token: str, producer: str = "") -> None:
        keys = [self.keys.counters, self.keys.once(token), self.keys.held]
        self._incr_once(keys=keys, args=[field, n, IDEMPOTENCY_TTL_S, producer])

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
        return self._entries([(eid, fields) for _, entries in reply or [] for eid, fields in entries if fields])

    def _entries(self, rows: list[tuple]) -> list[Entry]:
        """Entries of delivered stream rows, each marked admitted iff it holds its group id's claim."""
        if not rows:
            return []
        gids = [_text(fields.get(b"gid")) for _, fields in rows]
        claims = self._claim(
            keys=[self.keys.unacked], args=[x for (eid, _), g in zip(rows, gids, strict=True) for x in (_id(eid), g)]
        )
        rows = zip(rows, gids, claims, strict=True)
        return [_entry(eid, fields, gid, bool(claim)) for (eid, fields), gid, claim in rows]

    def _read(self, consumer: str, count: int, block: int | None):
        return self._r.xreadgroup(GROUP, consumer, {self.keys.traj: ">"}, count=count, block=block)

    @_retrying
    def pending(self, consumer: str) -> list[Entry]:
        out: list[Entry] = []
        start = "0"
        while True:  # reading id "0" onwards returns this consumer's pending entries, in order
            reply = self._r.xreadgroup(GROUP, consumer, {self.keys.traj: start}, count=1000)
            entries = [(eid, fields) for _, batch in reply or [] for eid, fields in batch]
            if not entries:
                return out
            # an entry deleted while pending comes back with no fields; there is nothing to redo
            out.extend(self._entries([(eid, fields) for eid, fields in entries if fields]))
            start = entries[-1][0]

    @_retrying
    def pending_ids(self, consumer: str) -> list[str]:
        out: list[str] = []
        start = "-"
        while True:
            rows = self._r.xpending_range(self.keys.traj, GROUP, min=start, max="+", count=1000, consumername=consumer)
            out.extend(_id(r["message_id"]) for r in rows)
            if len(rows) < 1000:
                return out
            start = "(" + out[-1]

    @_retrying
    def ack(self, entries: Sequence[Entry], outcome: str) -> int:
        counter = _outcome_counter(outcome)
        if not entries:
            return 0
        pairs = [x for e in entries for x in (e.entry_id, e.gid)]
        keys = [self.keys.traj, self.keys.counters, self.keys.unacked]
        return int(self._ack(keys=keys, args=[GROUP, counter, *pairs]))

    @_retrying
    def dead_letter(self, entry: Entry, reason: str) -> str | None:
        keys = [self.keys.traj, self.keys.counters, self.keys.dead, self.keys.unacked]
        head = bytes(entry.frame[:DEAD_FRAME_MAX_BYTES])
        size = len(entry.frame)
        args = [GROUP, entry.entry_id, entry.gid, str(reason), entry.producer, size, head, DEAD_MAX_ENTRIES]
        return {0: None, 1: "dead", 2: "foreign"}[int(self._dead(keys=keys, args=args))]

    @_retrying
    def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        check_count("count", count)
        if count == 0:
            return []
        rows = self._r.xrevrange(self.keys.dead, count=count)
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
        self._r.set(self.keys.version, int(v))

    @_retrying
    def get_version(self) -> int:
        raw = self._r.get(self.keys.version)
        return int(raw) if raw is not None else 0

    @_retrying
    def stats(self) -> dict[str, int]:
        pipe = self._r.pipeline(transaction=True)  # MULTI/EXEC: one consistent snapshot
        pipe.hgetall(self.keys.counters)
        pipe.xlen(self.keys.traj)
        pipe.xpending(self.keys.traj, GROUP)
        pipe.hlen(self.keys.unacked)
        counters, length, pending, pushed_in_buffer = pipe.execute()
        out = {k: int(counters.get(k.encode(), 0)) for k in COUNTER_KEYS}
        out["pending"] = int(pending["pending"])
        # Acknowledged entries are deleted, so the stream holds exactly the queued + pending ones.
        out["queued"] = int(length) - out["pending"]
        # Pushed groups in the stream are the unacked ones; anything else there is foreign. (Never
        # below 0: a pushed entry missing from the stream, deleted behind our back, shows as lost.)
        out["foreign_in_buffer"] = max(0, int(length) - int(pushed_in_buffer))
        return out

    def close(self) -> None:
        self._r.close()


def _id(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def _text(value: bytes | None, default: str = "") -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else default


def _entry(entry_id: bytes | str, fields: dict, gid: str, admitted: bool) -> Entry:
    """An Entry of a stream row of any shape: a row without a frame is kept, marked malformed."""
    producer = _text(fields.get(b"producer"), "unknown")
    frame = fields.get(b"frame")
    names = sorted(_text(k) for k in fields)[:8]
    malformed = None if frame is not None else f"entry has no frame field (fields: {names})"
    return Entry(_id(entry_id), frame or b"", producer, gid, admitted, malformed)


def _outcome_counter(outcome: str) -> str:
    try:
        return OUTCOMES[outcome]
    except KeyError:
        raise ValueError(f"unknown outcome {outcome!r}; expected one of {sorted(OUTCOMES)}") from None
