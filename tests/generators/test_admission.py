"""A generator's claims under admission control (``Generator.admit``), on a real in-memory buffer: what it
claims, and when it asks the buffer at all (each ask is a Redis round trip on a real run)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from asyncrl.buffers import MemoryBuffer
from asyncrl.generators.generator import Generator


class CountingBuffer(MemoryBuffer):
    """A MemoryBuffer that counts the snapshots admission reads."""

    def __init__(self, between=lambda: None):
        super().__init__()
        self.asked, self.between = 0, between  # ``between``: what happens after the snapshot, before the claims

    def stats(self) -> dict[str, int]:
        self.asked += 1
        snapshot = super().stats()
        self.between()
        return snapshot


def generator(buffer: MemoryBuffer, fleet: int = 1, lag: int = 1, groups_per_step: int = 2) -> SimpleNamespace:
    """What ``Generator.admit`` reads of a generator with room for 8 groups serving version 0; the groups it
    starts are recorded in ``started`` (not run)."""
    gen = SimpleNamespace(
        cfg=SimpleNamespace(
            run=SimpleNamespace(steps=100, max_policy_lag=lag), learner=SimpleNamespace(groups_per_step=groups_per_step)
        ),
        buffer=buffer, ident="0", fleet=fleet, capacity=8, groups=set(), closed_at=None, started=[],
        pump=SimpleNamespace(next_version=0), feed=None, version=0,
    )  # fmt: skip
    gen._claim = lambda room, orphans: Generator._claim(gen, room, orphans)
    gen.run_group = lambda seq, saved=None: seq
    gen._start = gen.started.append
    return gen


def admit(gen, orphans: bool = False) -> int:
    return asyncio.run(Generator.admit(gen, orphans=orphans))


def test_a_closed_admission_is_asked_again_at_a_new_version_or_the_tick_not_at_each_groups_end():
    buffer = CountingBuffer()
    gen = generator(buffer)  # lag 1, 2 groups a step: 4 may start while version 0 is served
    assert admit(gen) == 4 and gen.started == [0, 1, 2, 3] and gen.closed_at == 0
    assert buffer.asked == 1
    assert admit(gen) == 0 and buffer.asked == 1  # a group's end: closed at this version, nothing asked
    assert admit(gen, orphans=True) == 0 and buffer.asked == 2  # the tick asks (the learner may give slots back)
    gen.pump.next_version = 1
    assert admit(gen) == 2 and gen.started[-2:] == [4, 5] and buffer.asked == 3  # a new version opens two more
    assert admit(gen) == 0 and buffer.asked == 3


def test_a_slot_given_back_is_claimed_at_the_tick():
    buffer = CountingBuffer()
    gen = generator(buffer)
    assert admit(gen) == 4
    buffer.release(1, reason="failed")  # a group that will never reach the buffer: its slot comes back
    assert admit(gen) == 0  # not at a group's end ...
    assert admit(gen, orphans=True) == 1 and gen.started[-1] == 4  # ... at the tick
    assert gen.closed_at == 0


def test_a_share_of_what_is_open_leaves_admission_open_for_the_next_ask():
    buffer = CountingBuffer()
    gen = generator(buffer, fleet=2, groups_per_step=4)  # 8 open at version 0, two generators: a share of 4
    assert admit(gen) == 4 and gen.closed_at is None
    assert admit(gen) == 2 and gen.closed_at is None  # half of the 4 the other generator left
    assert admit(gen) == 2 and gen.closed_at == 0  # the last 2 (a step's share at least, when open)
    assert buffer.asked == 3


def test_claims_lost_to_another_generator_close_admission_at_that_version():
    def another_generator_claims_six():
        for _ in range(6):
            assert buffer.try_start_group(0, 1, 4, producer="1") is not None
        buffer.between = lambda: None

    buffer = CountingBuffer(between=another_generator_claims_six)  # after this one's snapshot: 8 open, 2 left
    gen = generator(buffer, fleet=2, groups_per_step=4)
    assert admit(gen) == 2 and gen.closed_at == 0  # its share was 4: the third claim found none left
    assert admit(gen) == 0 and buffer.asked == 1
