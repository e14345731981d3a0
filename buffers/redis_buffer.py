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

from asyncrl.buffers import redis_scripts as scripts
from asyncrl.buffers.base import (
    CLAIM_PART,
    COUNTER_KEYS,
    DEAD_FRAME_MAX_BYTES,
    DEAD_MAX_ENTRIES,
    IDEMPOTENCY_TTL_S,
    OUTCOMES,
    SEEN_WINDOW,
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
        self._admit = self._r.register_script(scripts.ADMIT)
        self._ack = self._r.register_script(scripts.ACK)
        self._claim = self._r.register_script(scripts.CLAIM)
        self._dead = self._r.register_script(scripts.DEAD)
        self._incr_once = self._r.register_script(scripts.INCR_ONCE)
        self._release_held = self._r.register_script(scripts.RELEASE_HELD)
        self._journal = self._r.register_script(scripts.JOURNAL)
        self._take_orphan = self._r.register_script(scripts.TAKE_ORPHAN)
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
        keys = [self.keys.counters, self.keys.once(token), self.keys.admissions, self.keys.held, self.keys.journals]
        args = [limit, IDEMPOTENCY_TTL_S, ADMISSION_RECORDS, producer, self.keys.journal(""), CLAIM_PART]
        return int(self._admit(keys=keys, args=args))

    def admissions(self, after: str = "-", count: int = 10_000) -> list[tuple[int, int, int]]:
        """The admission records (oldest first, up to ``count``): (sequence, live groups after, limit)."""
        rows = self._r.xrange(self.keys.admissions, min=after, count=count)
        return [(int(f[b"seq"]), int(f[b"live"]), int(f[b"limit"])) for _, f in rows]

    @_retrying
    def push(self, group_id: str, frame: bytes, producer: str = "unknown", seq: int | None = None) -> bool:
        pipe = self._r.pipeline(transaction=True)  # MULTI/EXEC, one round trip
        pipe.xadd(self.keys.traj, {"gid": group_id, "producer": producer, "frame": frame})
        # EVAL, not EVALSHA: after a server restart EVALSHA would fail with NOSCRIPT inside EXEC,
        # after the XADD had run. The script body costs ~1 KB per push next to a ~100 KB frame.
        keys = (self.keys.seen, self.keys.traj, self.keys.counters, self.keys.unacked, self.keys.held)
        pipe.eval(scripts.PUSH, len(keys), *keys, group_id, SEEN_WINDOW, producer)
        if seq is not None:  # the journal ends with the push, in the same transaction
            pipe.hdel(self.keys.journals, seq).delete(self.keys.journal(seq))
        return bool(pipe.execute()[1])

    def release(
        self,
        n: int = 1,
        token: str | None = None,
        reason: str = "abandoned",
        producer: str | None = None,
        seq: int | None = None,
    ) -> None:
        check_release_reason(reason)
        check_count("n", n)
        if n:
            self._count_once(reason, n, token or new_token(), producer or "", seq)

    @_retrying
    def release_held(self, producer: str | None = None, *, resume: bool = False, reaped: int | None = None) -> int:
        keys = [self.keys.counters, self.keys.held, self.keys.journals, self.keys.orphans]
        args = [producer or "", "1" if resume else "0", "" if reaped is None else reaped, self.keys.journal("")]
        return int(self._release_held(keys=keys, args=args))

    @_retrying
    def journal(self, seq: int, part: str, state: bytes, producer: str) -> bool:
        keys = [self.keys.journals, self.keys.journal(seq)]
        return bool(self._journal(keys=keys, args=[seq, producer, part, state]))

    @_retrying
    def take_orphan(self, producer: str) -> tuple[int, dict[str, bytes]] | None:
        keys = [self.keys.journals, self.keys.orphans, self.keys.held, self.keys.counters]
        raw = self._take_orphan(keys=keys, args=[producer, self.keys.journal("")])
        if not raw:
            return None
        return int(raw[0]), {raw[i].decode(): raw[i + 1] for i in range(1, len(raw), 2)}

    @_retrying
    def orphans(self) -> int:
        return sum(owner == b"" for owner in self._r.hvals(self.keys.journals))

    def record_replays(self, n: int, token: str | None = None) -> None:
        check_count("n", n)
        if n:
            self._count_once("replayed", n, token or new_token())

    @_retrying
    def _count_once(self, field: str, n: int, token: str, producer: str = "", seq: int | None = None) -> None:
        keys = [self.keys.counters, self.keys.once(token), self.keys.held]
        if seq is None:
            self._incr_once(keys=keys, args=[field, n, IDEMPOTENCY_TTL_S, producer])
            return
        pipe = self._r.pipeline(transaction=True)  # the group's journal ends with its release
        pipe.eval(scripts.INCR_ONCE, len(keys), *keys, field, n, IDEMPOTENCY_TTL_S, producer)
        pipe.hdel(self.keys.journals, seq).delete(self.keys.journal(seq))
        pipe.execute()

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
