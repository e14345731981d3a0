"""The engine pump's rules against a scripted engine: turns submitted as episodes ask, weights applied
between steps as on_weight_update says (continue / abort / wait), held during an evaluation, and the
requests of cancelled episodes aborted. The real engine is tested in tests/generators/test_generator_vllm.py."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from asyncrl.generators.engine import Engine, Sampling, StepOutput
from asyncrl.generators.scheduler import EnginePump


class CountingEngine(Engine):
    """Each step gives every live request one token: ``100 * loaded + position`` (so a token says
    which weights made it); a request ends at its max_new_tokens."""

    max_model_len = 1000

    def __init__(self):
        self.live: dict[str, list] = {}
        self.loaded = 0
        self.steps = 0
        self.aborted: list[str] = []
        self.added: list[tuple[str, list[int]]] = []

    def add_request(self, request_id, prompt, sampling):
        self.live[request_id] = [list(prompt), sampling.max_new_tokens, 0]
        self.added.append((request_id, list(prompt)))

    def step(self):
        self.steps += 1
        outs = []
        for rid, req in list(self.live.items()):
            req[2] += 1
            done = req[2] >= req[1]
            outs.append(StepOutput(rid, [100 * self.loaded + req[2]], [-float(self.loaded)], done, "length"))
            if done:
                del self.live[rid]
        return outs

    def abort_requests(self, request_ids):
        self.aborted += request_ids
        for rid in request_ids:
            self.live.pop(rid, None)

    def load_weights(self, tensors):
        self.loaded = tensors["v"]


@dataclasses.dataclass
class Update:
    version: int
    tensors: dict
    checksum: str = "x"


class ScriptedFeed:
    """Offers version ``v`` once ``engine.steps`` reaches ``at``."""

    def __init__(self, engine: CountingEngine, at: int, v: int = 1):
        self.engine, self.at, self.v = engine, at, v
        self.version = 0
        self.probe_ids = None  # no probe

    def newer(self, timeout_ms: int = 0):
        if self.version < self.v and self.engine.steps >= self.at:
            return Update(self.v, {"v": self.v})
        return None

    def engine_tensors(self, update):
        return update.tensors  # a full version, no tied names

    def applied(self, update, seconds, probe=None):
        self.version = update.version


SAMPLING = Sampling(1, 1.0, 1.0, 4)


async def run_turns(pump: EnginePump, prompts: list[list[int]], sampling=SAMPLING):
    runner = asyncio.create_task(pump.run())
    try:
        return await asyncio.gather(*(pump.complete(p, sampling) for p in prompts))
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


def test_continue_keeps_the_tokens_and_carries_each_ones_version():
    engine = CountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=2), "continue")
    (c,) = asyncio.run(run_turns(pump, [[9]]))
    assert c.versions == [0, 0, 1, 1] and c.tokens == [1, 2, 101, 102]
    assert engine.added[-1][1] == [9, 1, 2]  # re-added with the tokens it had, for the rest


def test_abort_restarts_the_turn_under_the_new_weights():
    engine = CountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=2), "abort")
    (c,) = asyncio.run(run_turns(pump, [[9]]))
    assert c.versions == [1, 1, 1, 1] and c.tokens == [101, 102, 103, 104]


def test_wait_finishes_running_turns_first_and_starts_no_new_one_meanwhile():
    engine = CountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=1), "wait")

    async def scenario():
        runner = asyncio.create_task(pump.run())
        first = asyncio.create_task(pump.complete([1], SAMPLING))
        while engine.steps < 2:
            await asyncio.sleep(0)
        second = asyncio.create_task(pump.complete([2], SAMPLING))  # asks while the update waits
        a, b = await asyncio.gather(first, second)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        return a, b

    a, b = asyncio.run(scenario())
    assert a.versions == [0, 0, 0, 0] and b.versions == [1, 1, 1, 1]


def test_no_weights_are_applied_while_held():
    engine = CountingEngine()
    feed = ScriptedFeed(engine, at=1)
    pump = EnginePump(engine, feed, "continue")

    async def scenario():
        runner = asyncio.create_task(pump.run())
        async with pump.hold():
            held = await pump.complete([1], Sampling(1, 0.0, 1.0, 6))
        after = await pump.complete([2], SAMPLING)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        return held, after

    held, after = asyncio.run(scenario())
    assert held.versions == [0] * 6 and after.versions == [1] * 4


def test_a_cancelled_turn_is_aborted_in_the_engine():
    engine = CountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=10**9), "wait")

    async def scenario():
        runner = asyncio.create_task(pump.run())
        turn = asyncio.create_task(pump.complete([1], Sampling(1, 1.0, 1.0, 10**6)))
        while engine.steps < 3:
            await asyncio.sleep(0)
        turn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await turn
        while engine.live:
            await asyncio.sleep(0)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(scenario())
    assert len(engine.aborted) == 1 and not engine.live


def test_turns_are_batched_as_they_come_and_the_engine_idles_without_any():
    engine = CountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=10**9), "wait")
    comps = asyncio.run(run_turns(pump, [[i] for i in range(5)]))
    assert engine.steps == 4 and all(c.tokens == [1, 2, 3, 4] for c in comps)  # one batch of 5
    assert pump.take_idle_fraction() is not None
