"""The learner side of the buffer (``buffers/consumer.py``) on the in-memory buffer: outcomes,
replays, commit and recovery. The same code on a real Redis, with crashes and server restarts
interleaved at random, is driven by the state machine in ``test_buffer_model.py``."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.buffers import MemoryBuffer
from asyncrl.buffers.base import lost_groups
from asyncrl.buffers.consumer import BatchConsumer, ConsumerRules, StopRequested
from asyncrl.protocol import Sample, TrajectoryGroup, encode_group


def group(version: int, rewards=(0.0, 1.0), gid: str | None = None) -> TrajectoryGroup:
    samples = [
        Sample(np.array([5, 6], np.int32), np.array([-0.5, -0.25], np.float32), np.full(2, version, np.int32), r)
        for r in rewards
    ]
    g = TrajectoryGroup(np.array([1, 2, 3], np.int32), samples, prompt_index=0, epoch=0, producer="gen-0")
    if gid is not None:
        g.id = gid
    return g


def push(buf, *groups: TrajectoryGroup) -> None:
    for g in groups:
        assert buf.push(g.id, encode_group(g), producer=g.producer)


def make(buf, k=1, replay_times=1, filter_zero_variance=False, max_frame_bytes=1 << 20) -> BatchConsumer:
    policy = ConsumerRules(k, replay_times, filter_zero_variance, max_frame_bytes)
    return BatchConsumer(buf, "rank0", policy)


def never_stop() -> bool:
    return False


def stop_now() -> bool:
    return True


def test_unusable_groups_are_acknowledged_at_once_and_do_not_count() -> None:
    buf = MemoryBuffer()
    c = make(buf, k=1, filter_zero_variance=True, max_frame_bytes=2000)
    push(buf, group(0), group(3), group(3, rewards=(1.0, 1.0)), group(2), group(3))
    buf.push("junk", b"\xc1not msgpack", producer="gen-9")
    big = group(3, rewards=(0.0, 1.0))
    big.samples[0].tokens = np.zeros(400, np.int32)
    big.samples[0].logprobs = np.zeros(400, np.float32)
    big.samples[0].versions = np.full(400, 3, np.int32)
    push(buf, big)
    batch = c.take(2, version=3, block_ms=1, stop=never_stop)
    assert [g.version for g in batch.groups] == [3, 2]
    s = buf.stats()
    # version 0 is stale at 3 with k=1; equal rewards are filtered; junk and the oversize are dead
    assert (s["dropped_stale"], s["filtered"], s["dead"], s["pending"], s["queued"]) == (1, 1, 0, 2, 3)
    batch2 = c.take(1, version=3, block_ms=1, stop=never_stop)
    assert len(batch2.items) == 1
    for _ in range(2):  # each reads one frame (dead), finds nothing usable, stops
        with pytest.raises(StopRequested):
            c.take(1, version=3, block_ms=1, stop=stop_now)
    s = buf.stats()
    assert s["dead"] == 2
    assert [(d.producer, "msgpack" in d.reason or "max_frame_mb" in d.reason) for d in buf.dead_letters()] == [
        ("gen-9", True),
        ("gen-0", True),
    ]
    assert lost_groups(s) == 0


def test_a_group_from_a_discarded_future_is_stale() -> None:
    buf = MemoryBuffer()
    c = make(buf, k=2)
    push(buf, group(5), group(3))
    batch = c.take(1, version=3, block_ms=1, stop=never_stop)
    assert [g.version for g in batch.groups] == [3]
    assert buf.stats()["dropped_stale"] == 1


def test_what_the_groups_dropped_as_stale_held_is_counted_by_size() -> None:
    """The stale groups' samples and model tokens (the length bias of dropping them: run/stats.py), whether
    dropped as read or once held (read ahead, judged again at a later version)."""
    buf = MemoryBuffer()
    c = make(buf, k=1)
    long = group(0, rewards=(0.0, 1.0, 0.5))
    for s in long.samples:
        s.tokens, s.logprobs, s.versions = np.zeros(10, np.int32), np.zeros(10, np.float32), np.zeros(10, np.int32)
        s.mask = np.ones(10, np.uint8)
    push(buf, long, group(2), group(2))
    batch = c.take(1, version=2, block_ms=1, stop=never_stop)
    assert (batch.counts["stale"], batch.counts["stale_samples"], batch.counts["stale_tokens"]) == (1, 3, 30)
    assert batch.stale_lengths == [10, 10, 10]  # each sample's, for the learner's histogram
    c.give_back(c.take(1, version=2, block_ms=1, stop=never_stop))  # held, unused: judged again at version 4
    with pytest.raises(StopRequested):
        c.take(1, version=4, block_ms=1, stop=stop_now)
    assert c.totals["stale"] == 2
    assert (c.totals["stale_samples"], c.totals["stale_tokens"]) == (5, 34)
    push(buf, group(4))  # the group dropped while no batch was taken is in the next batch's lengths
    assert c.take(1, version=4, block_ms=1, stop=never_stop).stale_lengths == [2, 2]


def test_trained_groups_are_acknowledged_only_at_commit() -> None:
    buf = MemoryBuffer()
    c = make(buf)
    push(buf, group(0), group(0))
    batch = c.take(2, 0, 1, never_stop)
    c.trained(batch)
    assert (buf.stats()["trained"], buf.stats()["pending"]) == (0, 2)
    assert c.checkpoint_state() == {h.entry_id: 1 for h in batch.items}
    assert c.commit() == 2
    assert (buf.stats()["trained"], buf.stats()["pending"]) == (2, 0)
    assert c.checkpoint_state() == {}


def test_replays_fill_in_up_to_the_budget_while_fresh() -> None:
    buf = MemoryBuffer()
    c = make(buf, k=2, replay_times=2)
    a, b = group(0, gid="a"), group(0, gid="b")
    push(buf, a, b)
    first = c.take(2, 0, 1, never_stop)
    c.trained(first)
    push(buf, group(1, gid="c"))
    second = c.take(2, 1, 1, never_stop)  # the new one first, then one replay
    assert [g.id for g in second.groups] == ["c", "a"] and second.replays == 1
    c.trained(second)
    third = c.take(2, 2, 1, never_stop)  # no new groups: b once more, c once more; a is spent
    assert sorted(g.id for g in third.groups) == ["b", "c"] and third.replays == 2
    c.trained(third)
    with pytest.raises(StopRequested):  # everything used twice: nothing left to replay
        c.take(1, 2, 1, stop_now)
    assert buf.stats()["replayed"] == 3
    assert c.commit() == 3
    assert buf.stats()["trained"] == 3


def test_a_replay_that_went_stale_is_retired_as_trained() -> None:
    buf = MemoryBuffer()
    c = make(buf, k=1, replay_times=3)
    push(buf, group(0))
    c.trained(c.take(1, 0, 1, never_stop))
    push(buf, group(2))
    batch = c.take(1, 2, 1, never_stop)
    assert batch.replays == 0 and batch.groups[0].version == 2
    c.trained(batch)
    assert c.commit() == 1  # version 0 is stale at 2: done, acknowledged as trained
    assert c.commit(final=True) == 1  # the end of the run: the pool too


def test_a_stopped_take_keeps_what_it_had() -> None:
    buf = MemoryBuffer()
    c = make(buf)
    push(buf, group(0))
    with pytest.raises(StopRequested):
        c.take(2, 0, 1, stop_now)
    push(buf, group(0))
    assert len(c.take(2, 0, 1, never_stop).items) == 2
    assert lost_groups(buf.stats()) == 0


def test_a_batch_given_back_is_taken_again_with_its_uses() -> None:
    """A rank holding its batch when another saw the run's stop gives it back (``learners.trainer``):
    the new group and the replay come back in the next take, the replay with its use counted once."""
    buf = MemoryBuffer()
    c = make(buf, k=2, replay_times=2)
    push(buf, group(0, gid="a"))
    c.trained(c.take(1, 0, 1, never_stop))
    push(buf, group(1, gid="b"))
    batch = c.take(2, 1, 1, never_stop)
    assert [g.id for g in batch.groups] == ["b", "a"] and batch.replays == 1
    c.give_back(batch)
    assert c.checkpoint_state() == {batch.items[1].entry_id: 1}  # what a checkpoint at the stop records
    again = c.take(2, 1, 1, never_stop)
    assert [g.id for g in again.groups] == ["b", "a"] and again.replays == 1
    assert lost_groups(buf.stats()) == 0


def test_entries_from_a_lost_read_reply_are_adopted() -> None:
    buf = MemoryBuffer()
    c = make(buf)
    push(buf, group(0), group(0))
    lost = buf.read("rank0", 1, 0)  # delivered to rank0, but the reply never reached the consumer
    batch = c.take(2, 0, 1, never_stop)
    assert lost[0].entry_id in {h.entry_id for h in batch.items}


def test_recovery_judges_pending_entries_again_at_the_restored_version() -> None:
    buf = MemoryBuffer()
    c = make(buf, k=1, replay_times=2)
    push(buf, *(group(0, gid=f"g{i}") for i in range(4)))
    first = c.take(2, 0, 1, never_stop)
    c.trained(first)
    saved = c.checkpoint_state()  # committed at version 1: g0, g1 used once
    second = c.take(2, 1, 1, never_stop)  # g2, g3 (new first)
    c.trained(second)
    # crash before the next commit; restart from version 1 with `saved`
    restarted = make(buf, k=1, replay_times=2)
    counts = restarted.recover(1, saved)
    assert (counts["replay"], counts["fresh"], counts["trained"]) == (2, 2, 0)
    batch = restarted.take(2, 1, 1, never_stop)
    assert sorted(g.id for g in batch.groups) == ["g2", "g3"], "never-committed uses are redone first"
    # at version 3 (k=1) every version-0 group is stale: uses in the committed model were 1 for g0/g1
    restarted.trained(batch)
    again = make(buf, k=1, replay_times=2)
    counts = again.recover(3, {**restarted.checkpoint_state(), **saved})
    assert counts["trained"] == 4 and buf.stats()["trained"] == 4
    assert lost_groups(buf.stats()) == 0


def test_recovery_of_an_unused_stale_entry_drops_it() -> None:
    buf = MemoryBuffer()
    c = make(buf, k=0)
    push(buf, group(0), group(0))
    c.take(2, 0, 1, never_stop)  # read, never trained: the process died in the step
    counts = make(buf, k=0).recover(2, {})
    assert counts["stale"] == 2
    assert buf.stats()["dropped_stale"] == 2
