"""Run-wide coordination over the run's Redis server: metadata, heartbeats, metrics, stop.

Every process of a run talks to the same Redis (the buffer's); the keys are in ``asyncrl.keys``."""

from __future__ import annotations

import json
import time

import redis

from asyncrl.keys import RunKeys

HEARTBEAT_TTL_S = 30  # long enough for a generator busy in one engine call on a loaded 2-core machine


def connect(url: str) -> redis.Redis:
    """A client with bounded socket timeouts and retries, so a dead server is an error, not a hang."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        url,
        socket_timeout=30,
        socket_connect_timeout=5,
        # about 20 s of retries: rides out a restart of the launcher's redis-server (it notices a
        # death within a poll and restarts it in well under a second, plus the AOF load)
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), retries=14),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=10,
    )


class RunControl:
    def __init__(self, client: redis.Redis, prefix: str):
        self.r = client
        self.prefix = prefix
        self.keys = RunKeys(prefix)
        self.bad_metrics = 0  # metric entries read_metrics skipped (not a JSON object)

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
        """True for exactly one caller across all processes."""
        return bool(self.r.set(self.keys.claim(name), 1, nx=True))

    def forget_eval_claims(self, keep: set[int]) -> int:
        """Drop the claims ``eval:<v>`` of versions not in ``keep`` (evaluations that never reported:
        their generator died mid-way); returns how many."""
        dropped = 0
        for key in self.r.scan_iter(match=self.keys.claim("eval:*")):
            version = key.decode().rsplit(":", 1)[1]
            if not version.isdigit() or int(version) not in keep:
                dropped += self.r.delete(key)
        return dropped

    # -- in-flight groups ---------------------------------------------------------------------------
    def set_inflight(self, ident: str, n: int) -> None:
        """Groups this generator admitted and has not pushed yet."""
        self.r.hset(self.keys.inflight, ident, n)

    def take_all_inflight(self) -> int:
        """For a resumed launch: every generator's unpushed groups (none of them survived), reset to 0."""
        with self.r.pipeline() as p:  # MULTI: no increment can land between the read and the reset
            p.hgetall(self.keys.inflight)
            p.delete(self.keys.inflight)
            counts, _ = p.execute()
        return sum(int(v) for v in counts.values())

    def take_inflight(self, ident: str) -> int:
        """For the launcher after a generator died: its unpushed groups, reset to 0."""
        with self.r.pipeline() as p:
            p.hget(self.keys.inflight, ident)
            p.hset(self.keys.inflight, ident, 0)
            value, _ = p.execute()
        return int(value or 0)

    # -- heartbeats -------------------------------------------------------------------------------
    def heartbeat(self, role: str, ident: str, **fields: str | int | float) -> None:
        key = self.keys.heartbeat(role, ident)
        beat = {"time": time.time(), **fields}
        with self.r.pipeline(transaction=False) as p:
            p.hset(key, mapping=beat)
            p.expire(key, HEARTBEAT_TTL_S)
            p.hset(self.keys.seen_processes(role), ident, json.dumps(beat))
            p.execute()

    def forget_heartbeats(self) -> None:
        """Drop every live heartbeat (a resumed launch: the processes that sent them are gone)."""
        keys = list(self.r.scan_iter(match=self.keys.heartbeat("*", "*")))
        if keys:
            self.r.delete(*keys)

    def seen(self, role: str) -> dict[str, dict]:
        """Every process of ``role`` that ever sent a heartbeat: id -> its last one."""
        raw = self.r.hgetall(self.keys.seen_processes(role))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    # -- staleness of trained groups ----------------------------------------------------------------
    def count_staleness(self, values: list[int]) -> None:
        counts: dict[int, int] = {}
        for v in values:
            counts[int(v)] = counts.get(int(v), 0) + 1
        if counts:
            with self.r.pipeline(transaction=False) as p:
                for v, n in counts.items():
                    p.hincrby(self.keys.staleness, str(v), n)
                p.execute()

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
        self.r.xadd(self.keys.metrics, {"json": json.dumps(record)})

    def read_metrics(self, after: str = "0-0", count: int = 1000) -> tuple[str, list[dict]]:
        """(the last entry id read, the records after ``after``); entries that are not a JSON object
        in a ``json`` field are skipped and counted in ``bad_metrics``: one bad writer must not stop
        the launcher's progress."""
        entries = self.r.xrange(self.keys.metrics, min=f"({after}" if after != "0-0" else "-", count=count)
        records = []
        for _, fields in entries:
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
