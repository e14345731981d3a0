"""Behaviour of every Buffer backend (memory and a real Redis), and of the private redis-server.

The same tests run against both backends through the ``backend`` fixture; racing is done with
threads for both and with separate processes for Redis.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncrl.buffers import STAT_KEYS, Buffer, BufferUnavailableError, MemoryBuffer, run_prefix, setup
from asyncrl.buffers.base import CLAIM_PART, DEAD_FRAME_MAX_BYTES, Entry, live_groups
from asyncrl.buffers.redis_buffer import RedisBuffer
from asyncrl.config import MemoryBufferConfig, RedisBufferConfig
from asyncrl.errors import UserError
from asyncrl.fleet.redis_server import check_redis_url, redact_url, start_redis_server
from asyncrl.staleness import admission_limit, may_start_group

# ----- backends ---------------------------------------------------------------------------------


class Backend:
    """Makes fresh (empty) buffers, and more handles onto an existing one, of one backend."""

    def __init__(self, kind: str, url: str | None):
        self.kind, self.url = kind, url
        self._open: list[Buffer] = []

    def fresh(self) -> Buffer:
        buf = MemoryBuffer() if self.kind == "memory" else RedisBuffer(self.url, f"test:{{{uuid.uuid4().hex}}}:")
        self._open.append(buf)
        return buf

    def handle(self, buf: Buffer) -> Buffer:
        """Another client of the same buffer (memory: the object itself; Redis: a new connection)."""
        if self.kind == "memory":
            return buf
        other = RedisBuffer(self.url, buf.prefix)
        self._open.append(other)
        return other

    def close(self) -> None:
        for buf in self._open:
            buf.close()


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def backend(request) -> Backend:
    url = request.getfixturevalue("redis_server").url if request.param == "redis" else None
    b = Backend(request.param, url)
    yield b
    b.close()


@pytest.fixture
def buf(backend: Backend) -> Buffer:
    return backend.fresh()


def _race(n_threads: int, fn) -> list:
    """Run ``fn(i)`` in ``n_threads`` threads released together; return their results in order."""
    barrier = threading.Barrier(n_threads)
    results: list = [None] * n_threads
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as exc:  # surfaced below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return results


# ----- admission control ------------------------------------------------------------------------


def test_admission_bound_exact_under_racing_threads(backend: Backend) -> None:
    buf = backend.fresh()
    handles = [backend.handle(buf) for _ in range(8)]

    def grab(serving_version: int):
        def fn(i: int) -> list[int]:
            got = [handles[i].try_start_group(serving_version, 1, 4) for _ in range(12)]
            return [s for s in got if s is not None]

        return fn

    seqs = sorted(s for r in _race(8, grab(0)) for s in r)
    assert seqs == list(range(admission_limit(0, 1, 4)))  # (0+1+1)*4 = 8, each number once
    assert buf.stats()["started"] == 8

    seqs = sorted(s for r in _race(8, grab(2)) for s in r)  # a generator now serves version 2
    assert seqs == list(range(8, admission_limit(2, 1, 4)))
    assert buf.try_start_group(2, 1, 4) is None
    assert buf.stats()["started"] == 16


def test_k0_is_lockstep(buf: Buffer) -> None:
    """With max_policy_lag 0, B groups per version, then generators wait for fresh weights."""
    for v in range(3):
        assert [buf.try_start_group(v, 0, 2) for _ in range(3)] == [2 * v, 2 * v + 1, None]
        assert buf.try_start_group(v, 0, 2) is None


def _settle(buf: Buffer, n: int, outcome: str) -> None:
    """Push, read and acknowledge ``n`` groups with ``outcome`` (``dead``: onto dead letters)."""
    for _ in range(n):
        buf.push(uuid.uuid4().hex, b"frame")
    entries = buf.read("settler", n, 0)
    assert len(entries) == n
    if outcome == "dead":
        assert all(buf.dead_letter(e, "bad") == "dead" for e in entries)
    else:
        assert buf.ack(entries, outcome) == n


def test_unused_and_released_slots_are_given_back_and_replays_take_one(buf: Buffer) -> None:
    while buf.try_start_group(0, 1, 2) is not None:
        pass
    assert buf.stats()["started"] == 4
    _settle(buf, 2, "stale")
    assert [buf.try_start_group(0, 1, 2) for _ in range(3)] == [4, 5, None]
    buf.release(1)
    assert [buf.try_start_group(0, 1, 2) for _ in range(2)] == [6, None]
    _settle(buf, 1, "filtered")
    _settle(buf, 1, "dead")
    _settle(buf, 3, "trained")  # a trained group keeps its slot
    buf.record_replays(1)  # a replay takes one
    assert [buf.try_start_group(0, 1, 2) for _ in range(2)] == [7, None]
    buf.release(0)
    s = buf.stats()
    assert (s["started"], s["dropped_stale"], s["abandoned"], s["filtered"], s["dead"]) == (8, 2, 1, 1, 1)
    assert (s["trained"], s["replayed"]) == (3, 1)
    assert live_groups(s) == 4
    with pytest.raises(ValueError):
        buf.release(-1)
    with pytest.raises(ValueError):
        buf.ack([Entry("1-0", b"")], "eaten")


def test_retried_admission_and_release_count_once(buf: Buffer) -> None:
    """A retry after a lost reply repeats the token: it gets the first answer and counts nothing."""
    assert buf.try_start_group(0, 0, 2, token="t1") == 0
    assert buf.try_start_group(0, 0, 2, token="t1") == 0
    assert buf.try_start_group(0, 0, 2, token="t2") == 1
    assert buf.try_start_group(0, 0, 2, token="t3") is None
    assert buf.try_start_group(5, 0, 2, token="t3") is None, "a refusal is an answer too"
    buf.release(1, token="r1")
    buf.release(1, token="r1")
    buf.record_replays(2, token="p1")
    buf.record_replays(2, token="p1")
    s = buf.stats()
    assert (s["started"], s["abandoned"], s["replayed"]) == (2, 1, 2)


def test_a_producer_holds_what_it_was_admitted_for_until_it_pushes_or_releases(buf: Buffer) -> None:
    """A killed generator's slots come back exactly: admitted and not yet pushed or released, counted
    once through retried admissions, releases and pushes."""
    for token in ("a1", "a1", "a2"):  # a1 retried: two groups
        assert buf.try_start_group(0, 2, 4, token=token, producer="a") is not None
    assert buf.try_start_group(0, 2, 4, producer="b") is not None
    assert buf.try_start_group(0, 2, 4) is not None  # held by nobody
    assert buf.push("g1", b"frame", producer="a") and not buf.push("g1", b"frame", producer="a")  # + a retry
    buf.release(1, token="r", producer="a")
    buf.release(1, token="r", producer="a")
    assert buf.release_held("a") == 0, "a pushed one, released one: it holds nothing"
    assert buf.try_start_group(0, 2, 4, producer="a") is not None
    assert buf.release_held("nobody") == 0
    assert buf.release_held() == 2  # a's last and b's
    assert buf.release_held() == 0
    s = buf.stats()
    assert (s["started"], s["pushed"], s["abandoned"], live_groups(s)) == (5, 1, 3, 2)


def test_a_dead_producers_journaled_groups_become_orphans_that_keep_their_slots(buf: Buffer) -> None:
    """Held groups outlive their producer: their claims are journaled by the admission itself, so a producer dead
    at any instant after it leaves orphans with their slots still taken, each taken over once (with its journal)
    by another producer and ended by its push or release."""
    seqs = [buf.try_start_group(0, 2, 4, producer="a") for _ in range(3)]
    assert buf.journal(seqs[0], "0", b'{"turns": 1}', "a") and buf.journal(seqs[0], "1", b"x", "a")
    assert buf.journal(seqs[0], "0", b'{"turns": 2}', "a"), "a part is replaced"
    assert buf.journal(seqs[1], "0", b"y", "a")
    assert buf.release_held("a", resume=True) == 0, "every held group's claim is journaled: none given back"
    assert buf.orphans() == 3 and live_groups(buf.stats()) == 3, "the orphans keep their slots"
    assert not buf.journal(seqs[0], "0", b"late", "a"), "a stalled producer writes no more"
    claim = {CLAIM_PART: b"{}"}
    assert buf.take_orphan("b") == (seqs[0], {**claim, "0": b'{"turns": 2}', "1": b"x"})
    assert buf.take_orphan("c") == (seqs[1], {**claim, "0": b"y"})
    assert buf.take_orphan("c") == (seqs[2], claim), "admitted, nothing played: played again from the start"
    assert buf.take_orphan("c") is None and buf.orphans() == 0
    assert not buf.journal(seqs[0], "0", b"z", "c") and buf.journal(seqs[0], "0", b"z", "b")
    assert buf.push("g", b"frame", producer="b", seq=seqs[0])
    buf.release(1, producer="c", reason="failed", seq=seqs[1])
    buf.release(1, producer="c", seq=seqs[2])
    assert buf.release_held("b", resume=True) == 0 and buf.release_held("c", resume=True) == 0
    s = buf.stats()
    assert (s["started"], s["pushed"], s["failed"], s["abandoned"], s["resumed"], live_groups(s)) == (3, 1, 1, 1, 3, 1)


def test_orphans_are_given_back_when_nobody_will_resume_them(buf: Buffer) -> None:
    """release_held of every producer without resume (the run goes on without them) gives the orphans back
    too; with a count the fleet's reaper took already, only that many groups are orphaned."""
    seqs = [buf.try_start_group(0, 2, 4, producer="a") for _ in range(2)]
    for seq in seqs:
        buf.journal(seq, "0", b"s", "a")
    assert buf.release_held("a", resume=True) == 0 and buf.orphans() == 2
    assert buf.release_held() == 2 and buf.orphans() == 0 and buf.take_orphan("b") is None
    seq = buf.try_start_group(0, 2, 4, producer="b")
    buf.journal(seq, "0", b"s", "b")
    assert buf.release_held("b", resume=True, reaped=0) == 0 and buf.orphans() == 0, "it held none: no orphan"


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.integers(0, 4)),
        st.tuples(st.just("drop"), st.integers(0, 3)),
        st.tuples(st.just("release"), st.integers(0, 2)),
    ),
    max_size=30,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops, k=st.integers(0, 2), b=st.integers(1, 3))
def test_admission_matches_the_pure_rule(backend: Backend, ops, k: int, b: int) -> None:
    """Any sequence of starts, stale drops and releases: the buffer admits exactly what
    ``asyncrl.staleness.may_start_group`` allows, and numbers groups 0, 1, 2, ..."""
    buf = backend.fresh()
    started = given_back = 0
    for op, n in ops:
        if op == "start":
            want = may_start_group(n, started - given_back, k, b)
            got = buf.try_start_group(n, k, b)
            assert got == (started if want else None)
            started += want
        elif op == "drop" and given_back + n <= started:
            _settle(buf, n, "stale")
            given_back += n
        elif op == "release" and given_back + n <= started:
            buf.release(n)
            given_back += n
    assert buf.stats()["started"] == started


# ----- push, read, ack --------------------------------------------------------------------------


def test_duplicate_push_is_ignored(buf: Buffer) -> None:
    assert buf.push("g1", b"first") is True
    assert buf.push("g1", b"second") is False
    assert buf.push("g2", b"other") is True
    entries = buf.read("r0", 10, 0)
    assert [e.frame for e in entries] == [b"first", b"other"]
    buf.ack(entries, "trained")
    assert buf.push("g1", b"third") is False, "a group id stays taken after its entry is acknowledged"
    s = buf.stats()
    assert (s["pushed"], s["duplicates"], s["queued"]) == (2, 2, 0)


def test_racing_pushes_of_one_group_append_once(backend: Backend) -> None:
    buf = backend.fresh()
    handles = [backend.handle(buf) for _ in range(6)]
    wins = _race(6, lambda i: [handles[i].push(f"g{j}", b"x%d" % i) for j in range(10)])
    assert [sum(w[j] for w in wins) for j in range(10)] == [1] * 10
    s = buf.stats()
    assert (s["pushed"], s["duplicates"], s["queued"]) == (10, 50, 10)


def test_each_entry_goes_to_exactly_one_of_two_consumers(backend: Backend) -> None:
    buf = backend.fresh()
    producer, readers = backend.handle(buf), [backend.handle(buf), backend.handle(buf)]
    n = 60
    got: list[list] = [[], []]
    done = threading.Event()

    def consume(i: int) -> None:
        while not (done.is_set() and buf.stats()["queued"] == 0):
            entries = readers[i].read(f"rank{i}", 4, 20)
            got[i].extend(entries)
            readers[i].ack(entries, "trained")

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for j in range(n):
        producer.push(f"g{j}", b"frame-%d" % j)
    done.set()
    for t in threads:
        t.join(20)
    ids = [[e.entry_id for e in g] for g in got]
    assert not set(ids[0]) & set(ids[1])
    assert sorted(e.frame for g in got for e in g) == sorted(b"frame-%d" % j for j in range(n))
    for g in got:  # each consumer sees its entries in append order
        frames = [int(e.frame.split(b"-")[1]) for e in g]
        assert frames == sorted(frames)
    s = buf.stats()
    assert (s["pushed"], s["trained"], s["queued"], s["pending"]) == (n, n, 0, 0)


def test_read_blocks_until_a_push_or_the_timeout(backend: Backend) -> None:
    buf = backend.fresh()
    t0 = time.monotonic()
    assert buf.read("r0", 5, 150) == []
    assert time.monotonic() - t0 >= 0.1
    assert buf.read("r0", 5, 0) == []  # 0: no blocking (not Redis' "forever")
    assert buf.read("r0", 0, 10) == []

    pusher = backend.handle(buf)
    timer = threading.Timer(0.1, lambda: pusher.push("late", b"late"))
    timer.start()
    t0 = time.monotonic()
    entries = buf.read("r0", 5, 5000)
    timer.join()
    assert [e.frame for e in entries] == [b"late"]
    assert time.monotonic() - t0 < 3.0


def test_unacked_entries_stay_pending_for_their_consumer(buf: Buffer) -> None:
    for j in range(3):
        buf.push(f"g{j}", b"%d" % j)
    first = buf.read("rank0", 2, 0)
    assert len(first) == 2
    assert (buf.stats()["queued"], buf.stats()["pending"]) == (1, 2)
    assert buf.pending("rank1") == []  # delivered to rank0 only
    # rank0 "crashed": the restarted rank0 gets its pending entries back, in order, without new ones.
    again = buf.pending("rank0")
    assert again == first
    # repeats and unknown ids are ignored and not counted
    assert buf.ack([*again, again[0], Entry("1-1", b"")], "trained") == 2
    assert buf.ack([again[0]], "stale") == 0
    s = buf.stats()
    assert (s["trained"], s["dropped_stale"], s["pending"], s["queued"]) == (2, 0, 0, 1)
    assert [e.frame for e in buf.read("rank1", 10, 0)] == [b"2"]


# ----- dead letters, versions, stats ------------------------------------------------------------


def test_pending_gives_a_consumer_back_its_own_entries(buf: Buffer) -> None:
    for j in range(4):
        buf.push(f"g{j}", b"%d" % j, producer=f"gen-{j % 2}")
    mine, theirs = buf.read("rank0", 2, 0), buf.read("rank1", 1, 0)
    assert buf.pending("rank0") == mine
    assert buf.pending("rank1") == theirs
    assert buf.pending("rank7") == []
    assert [e.producer for e in mine] == ["gen-0", "gen-1"]
    buf.ack([mine[0]], "trained")
    assert buf.pending("rank0") == mine[1:]


def test_dead_letters_are_kept_and_counted(buf: Buffer) -> None:
    big = b"x" * (DEAD_FRAME_MAX_BYTES + 10)
    buf.push("a", b"\xc1garbage", producer="gen-3")
    buf.push("b", big, producer="gen-1")
    first, second = buf.read("rank0", 2, 0)
    assert buf.dead_letter(first, "not msgpack") == "dead"
    assert buf.dead_letter(first, "not msgpack") is None, "counted once"
    assert buf.dead_letter(second, "oversize") == "dead"
    s = buf.stats()
    assert (s["dead"], s["pending"], s["queued"]) == (2, 0, 0)
    letters = buf.dead_letters()
    assert [(d.reason, d.producer) for d in letters] == [("not msgpack", "gen-3"), ("oversize", "gen-1")]
    assert letters[0].frame == b"\xc1garbage"
    assert (letters[1].size, len(letters[1].frame)) == (len(big), DEAD_FRAME_MAX_BYTES)
    assert [d.reason for d in buf.dead_letters(1)] == ["oversize"]
    assert buf.dead_letters(0) == []


def test_the_duplicate_window_is_bounded(buf: Buffer, monkeypatch) -> None:
    import asyncrl.buffers.memory as memory_mod
    import asyncrl.buffers.redis_buffer as redis_mod

    monkeypatch.setattr(memory_mod, "SEEN_WINDOW", 3)
    monkeypatch.setattr(redis_mod, "SEEN_WINDOW", 3)
    for j in range(5):
        assert buf.push(f"g{j}", b"x")
    assert not buf.push("g4", b"x") and not buf.push("g2", b"x"), "recent ids are still duplicates"
    assert buf.push("g0", b"x"), "ids older than the window are forgotten"


def test_version_is_shared(backend: Backend) -> None:
    buf = backend.fresh()
    other = backend.handle(buf)
    assert buf.get_version() == 0
    buf.set_version(7)
    assert other.get_version() == 7
    other.set_version(8)
    assert buf.get_version() == 8


def test_stats_start_at_zero(buf: Buffer) -> None:
    assert buf.stats() == dict.fromkeys(STAT_KEYS, 0)


# ----- Redis only: processes, server lifecycle, failures ----------------------------------------

_RACER = """
import json, sys
from asyncrl.buffers.redis_buffer import RedisBuffer
buf = RedisBuffer(sys.argv[1], sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()  # start line: all processes begin together
seqs = [s for s in (buf.try_start_group(0, 1, 5) for _ in range(40)) if s is not None]
wins = [buf.push(f"g{j}", b"p") for j in range(10)]
print(json.dumps({"seqs": seqs, "wins": wins}))
"""


@pytest.mark.redis
def test_admission_and_dedup_exact_across_processes(redis_server) -> None:
    prefix = run_prefix(uuid.uuid4().hex)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, redis_server.url, prefix],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(3)
    ]
    for p in procs:  # wait until all have imported and connected, then release them together
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [json.loads(p.communicate(timeout=30)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(s for o in outs for s in o["seqs"]) == list(range(admission_limit(0, 1, 5)))
    assert [sum(o["wins"][j] for o in outs) for j in range(10)] == [1] * 10
    with RedisBuffer(redis_server.url, prefix) as buf:
        s = buf.stats()
    assert (s["started"], s["pushed"], s["duplicates"]) == (10, 10, 20)


@pytest.mark.redis
def test_server_requires_the_password_and_binds_loopback(redis_server) -> None:
    no_retry = Retry(NoBackoff(), 0)  # redis-py retries even authentication errors by default
    anonymous = redis.Redis(port=redis_server.port, socket_timeout=2, retry=no_retry)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=redis_server.port, password="wrong", socket_timeout=2, retry=no_retry).ping()
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    assert r.ping()
    conf = {k: r.config_get(k)[k] for k in ("bind", "protected-mode", "appendonly", "appendfsync")}
    assert conf == {
        "bind": "127.0.0.1",
        "protected-mode": "yes",
        "appendonly": "yes",
        "appendfsync": "always",
    }
    cmdline = Path(f"/proc/{redis_server.pid}/cmdline")
    if cmdline.exists():
        assert redis_server.password not in cmdline.read_text()
    assert redis_server.password not in repr(redis_server)
    assert redact_url(redis_server.url) == f"redis://:***@127.0.0.1:{redis_server.port}/0"
    r.close()
    anonymous.close()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.redis
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_stop_and_kill_leave_no_process(make_redis_server, how: str) -> None:
    server = make_redis_server(appendonly=False)
    pid = server.pid
    assert server.is_running() and not _gone(pid)
    getattr(server, how)()
    assert not server.is_running() and server.pid is None
    assert _gone(pid)
    server.stop()  # idempotent


@pytest.mark.redis
def test_restart_keeps_port_password_and_data(make_redis_server) -> None:
    server = make_redis_server()
    url = server.url
    buf = RedisBuffer(url, "run:")
    buf.try_start_group(0, 1, 2)
    buf.push("g0", b"a")
    buf.push("g1", b"b")
    pending = buf.read("rank0", 1, 0)
    buf.set_version(3)
    server.restart()  # SIGTERM flushes the append-only file
    assert server.url == url
    s = buf.stats()  # the old client reconnects by itself
    assert (s["started"], s["pushed"], s["pending"], s["queued"]) == (1, 2, 1, 1)
    assert buf.get_version() == 3
    assert buf.pending("rank0") == pending
    assert buf.push("g0", b"a") is False
    buf.close()


@pytest.mark.redis
def test_client_rides_through_a_short_outage_then_fails_clearly(make_redis_server) -> None:
    server = make_redis_server()
    buf = RedisBuffer(server.url, "run:")
    server.stop()
    restarter = threading.Timer(0.3, server.restart)
    restarter.start()
    assert buf.push("g0", b"a") is True  # retried with back-off until the server is back
    restarter.join()
    server.stop()
    with pytest.raises(BufferUnavailableError, match=rf"127\.0\.0\.1:{server.port}") as info:
        RedisBuffer(server.url, "run:", retries=1, backoff_cap_s=0.05)
    assert server.password not in str(info.value)
    fast = RedisBuffer.__new__(RedisBuffer)  # the live client's view of a dead server, quickly
    fast.__dict__.update(buf.__dict__, retries=2, _backoff_cap_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(BufferUnavailableError, match="unreachable after 2 retries"):
        fast.stats()
    assert time.monotonic() - t0 < 2
    buf.close()


@pytest.mark.redis
def test_wrong_credentials_are_a_user_error(redis_server) -> None:
    bad = f"redis://:nope@127.0.0.1:{redis_server.port}/0"
    with pytest.raises(UserError, match="refused the credentials"):
        RedisBuffer(bad, "x:")
    with pytest.raises(UserError, match=rf"cannot reach Redis at 127\.0\.0\.1:{redis_server.port}") as info:
        check_redis_url(bad)
    assert "nope" not in str(info.value)
    check_redis_url(redis_server.url)


def test_check_redis_url_on_a_closed_port_names_the_address() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UserError, match=rf"cannot reach Redis at 127\.0\.0\.1:{port}") as info:
        check_redis_url(f"redis://:hunter2@127.0.0.1:{port}/0", timeout_s=1)
    assert "hunter2" not in str(info.value)


# ----- redis-server start-up errors (no real binary needed) -------------------------------------


def test_missing_binary_is_a_user_error_saying_how_to_install(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="apt-get install redis-server"):
        start_redis_server(tmp_path)
    with pytest.raises(UserError, match="no-such-redis not found"):
        start_redis_server(tmp_path, binary="no-such-redis")


def _fake_binary(tmp_path: Path, body: str) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "redis-server"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)
    return bindir


def test_server_that_exits_at_start_reports_its_log(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(_fake_binary(tmp_path, "echo 'FATAL: bad config line' ; exit 1")))
    with pytest.raises(UserError, match="exited with code 1(.|\n)*FATAL: bad config line"):
        start_redis_server(tmp_path / "data")


def test_server_that_never_answers_times_out_and_is_killed(tmp_path, monkeypatch) -> None:
    pidfile, sleep = tmp_path / "pid", shutil.which("sleep") or "/bin/sleep"
    monkeypatch.setenv("PATH", str(_fake_binary(tmp_path, f"echo $$ > {pidfile}; echo starting; exec {sleep} 60")))
    t0 = time.monotonic()
    with pytest.raises(UserError, match="did not answer PING(.|\n)*starting"):
        start_redis_server(tmp_path / "data", timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    assert _gone(int(pidfile.read_text()))


# ----- setup() ----------------------------------------------------------------------------------


def test_setup_memory_shares_one_buffer_per_prefix() -> None:
    cfg = MemoryBufferConfig()
    a, b, c = setup(cfg, None, "p1:"), setup(cfg, None, "p1:"), setup(cfg, None, "p2:")
    assert isinstance(a, MemoryBuffer) and a is b and a is not c


def test_setup_redis_needs_a_url() -> None:
    with pytest.raises(UserError, match="needs a Redis URL"):
        setup(RedisBufferConfig(), None, "p:")


@pytest.mark.redis
def test_setup_redis_connects_with_url_or_config(redis_server) -> None:
    prefix = run_prefix("setup-test")
    assert prefix == "asyncrl:{setup-test}:"
    with setup(RedisBufferConfig(), redis_server.url, prefix) as a:
        assert isinstance(a, RedisBuffer) and a.prefix == prefix
        a.set_version(2)
    with setup(RedisBufferConfig(url=redis_server.url), None, prefix) as b:
        assert b.get_version() == 2


def test_pending_ids_match_pending(buf: Buffer) -> None:
    for j in range(3):
        buf.push(f"g{j}", b"%d" % j)
    mine = buf.read("rank0", 3, 0)
    assert buf.pending_ids("rank0") == [e.entry_id for e in mine]
    assert buf.pending_ids("rank1") == []
