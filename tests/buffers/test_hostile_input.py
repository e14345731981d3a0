"""Whatever lands in a run's Redis, a learner rank never crashes on it and the accounting stays exact
(issue 11, defects 1-3): a stream entry of any shape ends in dead letters with its reason, a bad metrics
record is skipped and counted, and entries that no generator pushed through admission (raw stream
writes) neither break ``pushed = outcomes + in buffer`` nor loosen the admission bound."""

from __future__ import annotations

import contextlib
import uuid
from unittest import mock

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.connection import Connection
from test_consumer import group, make, never_stop, push

from asyncrl.buffers.base import live_groups, lost_groups
from asyncrl.buffers.consumer import StopRequested
from asyncrl.buffers.redis_buffer import RedisBuffer
from asyncrl.control import RunControl, connect
from asyncrl.keys import RunKeys, run_prefix
from asyncrl.protocol import encode_group

pytestmark = pytest.mark.redis


@pytest.fixture
def buf(redis_server):
    b = RedisBuffer(redis_server.url, run_prefix(f"hostile-{uuid.uuid4().hex[:8]}"))
    yield b
    b.close()


def raw_xadd(buf: RedisBuffer, fields: dict) -> None:
    """What a neighbour with the password can do: append to the stream without push()."""
    buf._r.xadd(RunKeys(buf.prefix).traj, fields)


def test_an_entry_without_a_frame_ends_in_dead_letters_with_its_reason(buf):
    raw_xadd(buf, {"gid": "x", "producer": "intruder"})  # no frame field
    raw_xadd(buf, {"frame": "not bytes of a group"})
    raw_xadd(buf, {"something": "else"})
    push(buf, group(0))
    batch = make(buf).take(1, version=0, block_ms=1, stop=never_stop)
    assert len(batch.groups) == 1
    letters = buf.dead_letters()
    assert len(letters) == 3
    assert "no frame" in letters[0].reason and letters[0].producer == "intruder"
    s = buf.stats()
    assert s["foreign"] == 3 and s["dead"] == 0 and lost_groups(s) == 0


def test_raw_entries_keep_the_accounting_identity_and_the_admission_bound(buf):
    for _ in range(3):
        assert buf.try_start_group(0, 0, 3) is not None
    push(buf, group(0, gid="a"))
    for i in range(10):  # well-formed frames, but never admitted nor pushed
        raw_xadd(buf, {"gid": f"raw{i}", "producer": "intruder", "frame": encode_group(group(0))})
    raw_xadd(buf, {"gid": "a", "producer": "intruder", "frame": encode_group(group(0))})  # a copy of a pushed id
    push(buf, group(0, gid="b"), group(0, gid="c"))
    before = buf.stats()
    assert buf.try_start_group(0, 0, 3) is None  # the window is full
    s = buf.stats()
    assert lost_groups(s) == 0 and s["foreign_in_buffer"] == 11
    batch = make(buf).take(3, version=0, block_ms=1, stop=never_stop)
    assert [g.id for g in batch.groups] == ["a", "b", "c"]  # only what was pushed is trained
    s = buf.stats()
    assert s["foreign"] == 11 and s["foreign_in_buffer"] == 0 and s["dead"] == 0
    assert lost_groups(s) == 0
    assert live_groups(s) == live_groups(before)  # dead-lettered raw entries give back no slot
    assert buf.try_start_group(0, 0, 3) is None  # still full: the bound is the generators' alone
    assert buf.ack([h.entry for h in batch.items], "trained") == 3
    assert buf.ack([h.entry for h in batch.items], "trained") == 0  # a retried acknowledgement counts once
    s = buf.stats()
    assert (s["trained"], s["foreign"], lost_groups(s)) == (3, 11, 0)


def test_a_bad_metrics_record_is_skipped_and_counted(redis_server):
    control = RunControl(connect(redis_server.url), run_prefix(f"metrics-{uuid.uuid4().hex[:8]}"))
    control.emit({"learner/version": 1})
    control.r.xadd(control.keys.metrics, {"json": b"{not json"})
    control.r.xadd(control.keys.metrics, {"other": b"1"})
    control.r.xadd(control.keys.metrics, {"json": b"[1, 2]"})  # JSON, but not a record
    control.emit({"learner/version": 2})
    _, records = control.read_metrics()
    assert [r["learner/version"] for r in records] == [1, 2]
    assert control.bad_metrics == 3


@contextlib.contextmanager
def replies_lost(commands: set[str]):
    """The reply to the first of ``commands`` is lost after the server ran it (the connection drops at the
    read, as when a redis-server is killed between the two): redis-py's retry then sends it again."""
    real, lost = Connection.read_response, []

    def read_response(self, *args, **kwargs):
        if self._asyncrl_last in commands and self._asyncrl_last not in lost:
            lost.append(self._asyncrl_last)
            self.disconnect()
            raise redis.ConnectionError("reply lost")
        return real(self, *args, **kwargs)

    real_send = Connection.send_command

    def send_command(self, *args, **kwargs):
        self._asyncrl_last = str(args[0]).upper()
        return real_send(self, *args, **kwargs)

    with (
        mock.patch.object(Connection, "read_response", read_response),
        mock.patch.object(Connection, "send_command", send_command),
    ):
        yield lost


def test_a_retried_emit_claim_or_count_counts_once(redis_server):
    """Every command of a RunControl is retried on a connection error; an XADD, SET NX or staleness count whose
    reply was lost had run: the metrics reader keeps one copy, the claim is still the claimant's, the histogram
    counts once."""
    control = RunControl(connect(redis_server.url), run_prefix(f"metrics-{uuid.uuid4().hex[:8]}"))
    other = RunControl(connect(redis_server.url), control.prefix)
    with replies_lost({"XADD", "SET", "EVALSHA"}) as lost:
        control.emit({"learner/version": 1})
        assert control.claim_once("eval:1")
        control.count_staleness([0, 0, 1])
    assert lost == ["XADD", "SET", "EVALSHA"]
    assert control.staleness_histogram() == {0: 2, 1: 1}, "a retried count adds once"
    control.emit({"learner/version": 2})
    assert control.r.xlen(control.keys.metrics) == 3  # the retried XADD ran twice
    _, records = other.read_metrics()
    assert [r["learner/version"] for r in records] == [1, 2] and other.repeated_metrics == 1
    assert not other.claim_once("eval:1")


def test_records_of_the_wrong_shape_do_not_stop_the_progress(redis_server, tmp_path):
    from asyncrl.config import RunConfig
    from asyncrl.run.stats import RunStats

    control = RunControl(connect(redis_server.url), run_prefix(f"metrics-{uuid.uuid4().hex[:8]}"))
    stats = RunStats(RunConfig(steps=2), tmp_path)
    good = {"learner/samples": 4, "buffer/staleness_mean": 0.0, "buffer/staleness_max": 0, "buffer/dropped_stale": 0}
    control.emit({**good, "learner/version": 1, "learner/wall_seconds": 1.0})
    control.emit({"learner/version": 2})  # missing fields
    control.emit({"eval/reward_mean": 0.5, "eval/version": "two"})  # wrong type
    control.r.xadd(control.keys.metrics, {"json": b"\xff\xfe"})
    control.emit({**good, "learner/version": 2, "learner/wall_seconds": 2.0})
    stats.drain(control)
    assert stats.version == 2 and stats.samples == 8
    assert stats.summary("completed")["bad_metric_records"] == 3


# ----- wire fuzz: any entry of any shape, raw or pushed, into a live buffer ---------------------

_scalars = st.one_of(st.binary(max_size=64), st.text(max_size=32), st.integers(-(2**63), 2**63 - 1), st.floats())
_nested = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**31), 2**31), st.text(max_size=16), st.binary(max_size=16)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _frame_like(group_frame: bytes):
    """Frames from plausible to hostile: a real group cut or bit-flipped, nested msgpack, huge bytes."""
    return st.one_of(
        st.just(group_frame),
        st.integers(0, len(group_frame)).map(lambda n: group_frame[:n]),
        st.tuples(st.integers(0, len(group_frame) - 1), st.integers(1, 255)).map(
            lambda p: group_frame[: p[0]] + bytes([group_frame[p[0]] ^ p[1]]) + group_frame[p[0] + 1 :]
        ),
        _nested.map(lambda v: msgpack.packb(v, use_bin_type=True)),
        st.dictionaries(st.sampled_from(["schema", "schema_version", "samples", "prompt_ids", "id"]), _nested).map(
            lambda d: msgpack.packb({"schema": "asyncrl.traj", "schema_version": 1, **d}, use_bin_type=True)
        ),
        st.integers(1, 3 << 20).map(lambda n: b"\x00" * n),  # up to 3 MiB: over the cap below
    )


_FRAME = encode_group(group(0))
_raw_fields = st.dictionaries(
    st.one_of(st.sampled_from(["gid", "producer", "frame"]), st.text(min_size=1, max_size=8)),
    st.one_of(_scalars, _frame_like(_FRAME)),
    min_size=1,
    max_size=4,
)
_entries = st.lists(
    st.one_of(
        st.tuples(st.just("raw"), _raw_fields),
        st.tuples(st.just("push"), _frame_like(_FRAME)),
    ),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(entries=_entries)
def test_fuzzed_entries_never_crash_a_learner_and_are_all_accounted_for(redis_server, entries):
    buf = RedisBuffer(redis_server.url, run_prefix(f"fuzz-{uuid.uuid4().hex[:8]}"))
    try:
        pushed = 0
        for i, (kind, payload) in enumerate(entries):
            if kind == "raw":
                raw_xadd(buf, payload)
            else:
                assert buf.try_start_group(0, 0, 1000) is not None
                pushed += buf.push(f"g{i}", payload, producer="fuzz")
        consumer = make(buf, k=0, max_frame_bytes=1 << 20)
        trained = 0
        while True:  # take whatever is usable until the stream is drained
            try:
                batch = consumer.take(1, version=0, block_ms=1, stop=lambda: True)
            except StopRequested:
                break
            trained += len(batch.groups)
            consumer.trained(batch)
        consumer.commit(final=True)
        s = buf.stats()
        assert lost_groups(s) == 0
        assert (s["queued"], s["pending"], s["foreign_in_buffer"]) == (0, 0, 0)
        assert s["pushed"] == pushed == s["trained"] + s["dead"] + s["dropped_stale"] + s["filtered"]
        assert s["trained"] == trained
        assert s["pushed"] + s["foreign"] == len(entries)  # every entry ended in exactly one place
    finally:
        buf.close()
