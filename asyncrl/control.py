"""Run-wide coordination over the run's Redis server: metadata, heartbeats, metrics, stop.

Every process of a run talks to the same Redis (the buffer's); the keys are in ``asyncrl.keys``."""

from __future__ import annotations

import collections
import itertools
import json
import secrets
import time

import redis

from asyncrl.keys import RUN_MARKERS, RunKeys

HEARTBEAT_TTL_S = 30  # learners: one heartbeat per step
# A generator renews its lease every tick (0.2 s; its engine runs on another thread): one not renewed
# for this long is dead or cut off, and its admission slots go back to the run.
MEMBER_TTL_S = 10.0
SEEN_EMITS = 4096  # a retried emit lands within seconds of its first copy: far fewer entries apart

# KEYS: leases, members, hb, seen. ARGV: id, token, ttl, beat JSON, take (1: join, taking the lease),
# then the beat's field/value pairs.
_RENEW = """
if ARGV[5] == '1' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
elseif redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then
  return 0
end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[2], tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[3]), ARGV[1])
local fields = {}
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[3], unpack(fields))
redis.call('EXPIRE', KEYS[3], math.ceil(tonumber(ARGV[3])))
redis.call('HSET', KEYS[4], ARGV[1], ARGV[4])
return 1
"""

# KEYS: leases, members, hb. ARGV: id, token.
_LEAVE = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('DEL', KEYS[3])
end
return 0
"""

# KEYS: histogram, once mark. ARGV: field, increment, field, increment, ... Applied once per mark (kept an hour).
_COUNT_ONCE = """
if not redis.call('SET', KEYS[2], 1, 'NX', 'EX', 3600) then return 0 end
for i = 1, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

# KEYS: members, leases, held. Returns {id, groups taken, ...} of every expired lease.
_REAP = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
  local n = tonumber(redis.call('HGET', KEYS[3], id)) or 0
  redis.call('HDEL', KEYS[3], id)
  out[#out + 1] = id
  out[#out + 1] = n
end
return out
"""


def connect(url: str, retries: int = 14) -> redis.Redis:
    """A client with bounded socket timeouts and retries, so a dead server is an error, not a hang.
    The launcher that owns the run's redis-server passes few retries: it is the one that restarts a
    dead server, so it must not wait out an outage it is the cure of."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        url,
        socket_timeout=30,
        socket_connect_timeout=5,
        # about 20 s of retries: rides out a restart of the launcher's redis-server (it notices a
        # death within a poll and restarts it in well under a second, plus the AOF load)
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), retries=retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=10,
    )


class RunControl:
    def __init__(self, client: redis.Redis, prefix: str):
        self.r = client
        self.prefix = prefix
        self.keys = RunKeys(prefix)
        self._renew = client.register_script(_RENEW)
        self._leave = client.register_script(_LEAVE)
        self._reap = client.register_script(_REAP)
        self._count_once = client.register_script(_COUNT_ONCE)
        self.bad_metrics = 0  # metric entries read_metrics skipped (not a JSON object)
        self.repeated_metrics = 0  # entries read_metrics skipped as a retried emit's second copy
        self._token = secrets.token_hex(6)  # this client's emits and claims, told from another's
        self._emits = itertools.count()
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # recent emits' ids

    # -- metadata ---------------------------------------------------------------------------------
    def set_meta(self, field: str, value: str | int | float) -> None:
        self.r.hset(self.keys.meta, field, value)

    def get_meta(self, field: str) -> str | None:
        value = self.r.hget(self.keys.meta, field)
        return None if value is None else value.decode()

    def forget_meta(self, field: str) -> None:
        self.r.hdel(self.keys.meta, field)

    def wait_meta(self, field: str, timeout_s: float, poll_s: float = 0.2) -> str:
        deadline = time.monotonic() + timeout_s
        while (value := self.get_meta(field)) is None:
            if time.monotonic() > deadline or self.stop_requested():
                raise TimeoutError(f"run metadata {field!r} did not appear within {timeout_s:.0f}s")
            time.sleep(poll_s)
        return value

    def claim_once(self, name: str) -> bool:
        """True for exactly one caller across all processes. The claim holds the caller's token: a SET
        retried after a restarting server ran it but lost the reply finds it there, and is still a win."""
        key = self.keys.claim(name)
        return bool(self.r.set(key, self._token, nx=True)) or self.r.get(key) == self._token.encode()

    def forget_eval_claims(self, keep: set[int]) -> int:
        """Drop the claims ``eval:<point>`` of eval points not in ``keep`` (evaluations that never reported:
        their generator died mid-way); returns how many."""
        dropped = 0
        for key in self.r.scan_iter(match=self.keys.claim("eval:*")):
            version = key.decode().rsplit(":", 1)[1]
            if not version.isdigit() or int(version) not in keep:
                dropped += self.r.delete(key)
        return dropped

    # -- membership: the live fleet -------------------------------------------------------------
    def new_id(self, role: str, host: str) -> str:
        """A fresh id for a process joining a running job: ``<host>-<n>``, n counted by the run."""
        return f"{host}-{self.r.incr(self.keys.ids(role))}"

    def join(self, role: str, ident: str, ttl_s: float = MEMBER_TTL_S) -> str:
        """Take the lease of ``ident`` (a restarted process takes over its predecessor's) and return
        its token: :meth:`renew` with it keeps the process a member; a lease not renewed within
        ``ttl_s`` expires and the process is out of the fleet (see :meth:`reap`)."""
        token = secrets.token_hex(8)
        self._beat(role, ident, token, ttl_s, {}, take=True)
        return token

    def renew(self, role: str, ident: str, token: str, ttl_s: float = MEMBER_TTL_S, **fields) -> bool:
        """Renew the lease and write the heartbeat; False when the lease is no longer this process's
        (it expired and was reaped, or a newer process took the id): the caller must stop at once,
        its admission slots were given back for it."""
        return self._beat(role, ident, token, ttl_s, fields, take=False)

    def _beat(self, role: str, ident: str, token: str, ttl_s: float, fields: dict, take: bool) -> bool:
        beat = {"time": time.time(), **fields}
        keys = [self.keys.leases(role), self.keys.members(role), self.keys.heartbeat(role, ident)]
        keys.append(self.keys.seen_processes(role))
        args = [ident, token, ttl_s, json.dumps(beat), int(take), *(x for kv in beat.items() for x in kv)]
        return bool(self._renew(keys=keys, args=args))

    def leave(self, role: str, ident: str, token: str) -> None:
        """Give up the lease (a clean exit): out of the fleet at once, not after it expires."""
        self._leave(keys=[self.keys.leases(role), self.keys.members(role), self.keys.heartbeat(role, ident)],
                    args=[ident, token])  # fmt: skip

    def members(self, role: str) -> list[str]:
        """The live fleet of ``role``: the ids whose lease has not expired (by Redis's clock)."""
        seconds, micros = self.r.time()
        live = self.r.zrangebyscore(self.keys.members(role), seconds + micros / 1e6, "+inf")
        return sorted(m.decode() for m in live)

    def reap(self, role: str) -> dict[str, int]:
        """End every expired lease of ``role`` (a SIGKILLed or cut-off process): out of the fleet, its
        lease cancelled so it stops if it was only stalled, and its unpushed groups taken for the caller
        to release. Returns id -> groups taken. Atomic, so two reapers never take a count twice."""
        raw = self._reap(keys=[self.keys.members(role), self.keys.leases(role), self.keys.held])
        return {raw[i].decode(): int(raw[i + 1]) for i in range(0, len(raw), 2)}

    # -- heartbeats -------------------------------------------------------------------------------
    def heartbeat(self, role: str, ident: str, **fields: str | int | float) -> None:
        """A process's state for ``asyncrl status`` (learners; generators heartbeat with :meth:`renew`)."""
        key = self.keys.heartbeat(role, ident)
        beat = {"time": time.time(), **fields}
        with self.r.pipeline(transaction=False) as p:
            p.hset(key, mapping=beat)
            p.expire(key, HEARTBEAT_TTL_S)
            p.hset(self.keys.seen_processes(role), ident, json.dumps(beat))
            p.execute()

    def forget_heartbeats(self) -> None:
        """Drop every live heartbeat and lease (a resumed launch: the processes that held them are gone)."""
        keys = list(self.r.scan_iter(match=self.keys.heartbeat("*", "*")))
        keys += [self.keys.members(role) for role in ("generator", "learner")]
        keys += [self.keys.leases(role) for role in ("generator", "learner")]
        if keys:
            self.r.delete(*keys)

    def seen(self, role: str) -> dict[str, dict]:
        """Every process of ``role`` that ever sent a heartbeat: id -> its last one."""
        raw = self.r.hgetall(self.keys.seen_processes(role))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    # -- staleness of trained groups ----------------------------------------------------------------
    def count_staleness(self, values: list[int]) -> None:
        """Add trained groups' staleness to the run's histogram, once: a retry of a call whose reply a
        dying server lost finds its ``once:<token>`` mark and adds nothing."""
        counts: dict[int, int] = {}
        for v in values:
            counts[int(v)] = counts.get(int(v), 0) + 1
        if counts:
            once = self.keys.once(f"staleness-{self._token}-{next(self._emits)}")
            self._count_once(keys=[self.keys.staleness, once], args=[x for kv in counts.items() for x in kv])

    def staleness_histogram(self) -> dict[int, int]:
        return {int(k): int(v) for k, v in self.r.hgetall(self.keys.staleness).items()}

    def heartbeats(self, role: str) -> dict[str, dict[str, str]]:
        out = {}
        for key in self.r.scan_iter(match=self.keys.heartbeat(role, "*")):
            ident = key.decode().rsplit(":", 1)[1]
            out[ident] = {k.decode(): v.decode() for k, v in self.r.hgetall(key).items()}
        return out

    # -- metrics ----------------------------------------------------------------------------------
    def emit(self, record: dict) -> None:
        """One record to the metrics stream, with an id of its own (``once``): the client retries an XADD
        whose reply a dying server lost, which may have run (the AOF syncs every write), and the reader
        keeps the first of two entries with one id."""
        once = f"{self._token}-{next(self._emits)}"
        self.r.xadd(self.keys.metrics, {"json": json.dumps(record), "once": once})

    def read_metrics(self, after: str = "0-0", count: int = 1000) -> tuple[str, list[dict]]:
        """(the last entry id read, the records after ``after``); entries that are not a JSON object
        in a ``json`` field are skipped and counted in ``bad_metrics``: one bad writer must not stop
        the launcher's progress. An entry whose ``once`` id came before (a retried emit) is skipped and
        counted in ``repeated_metrics``."""
        entries = self.r.xrange(self.keys.metrics, min=f"({after}" if after != "0-0" else "-", count=count)
        records = []
        for _, fields in entries:
            once = fields.get(b"once")
            if once is not None:
                if once in self._seen:
                    self.repeated_metrics += 1
                    continue
                self._seen[once] = None
                if len(self._seen) > SEEN_EMITS:
                    self._seen.popitem(last=False)
            record = _json_object(fields.get(b"json"))
            if record is None:
                self.bad_metrics += 1
            else:
                records.append(record)
        last = entries[-1][0].decode() if entries else after
        return last, records

    def trim_metrics(self, through: str) -> None:
        """Drop the entries before ``through`` (the last one logged), exactly: the launcher is the only
        reader, and a resumed launch reads on after the oldest entry left (``first_metrics_id``)."""
        if through != "0-0":
            self.r.xtrim(self.keys.metrics, minid=through, approximate=False)

    def first_metrics_id(self) -> str | None:
        """The id of the oldest metrics entry still in the stream (None if it is empty)."""
        entries = self.r.xrange(self.keys.metrics, count=1)
        return entries[0][0].decode() if entries else None

    # -- stop -------------------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        self.r.set(self.keys.stop, reason)

    def clear_stop(self) -> None:
        self.r.delete(self.keys.stop)

    def stop_requested(self) -> bool:
        return bool(self.r.exists(self.keys.stop))


def _json_object(raw: bytes | None) -> dict | None:
    try:
        value = json.loads(raw) if raw is not None else None
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def find_prefixes(client: redis.Redis) -> list[str]:
    """Every run prefix ``asyncrl:{<run-id>}:`` that has one of :data:`asyncrl.keys.RUN_MARKERS` on this server."""
    found = set()
    for name in RUN_MARKERS:
        for key in client.scan_iter(match=f"asyncrl:{{*}}:{name}", count=1000):
            key = key.decode(errors="replace")
            prefix = key[: key.find("}:") + 2]
            if prefix + name == key:
                found.add(prefix)
    return sorted(found)
