"""The engine pump's rules against a scripted engine: turns submitted as episodes ask, weights applied
between steps as on_weight_update says (continue / abort / wait), held during an evaluation, the
requests of cancelled episodes aborted, and a group's n samples of one prompt as one n-sample request
split per sample at an update. The real engine is tested in tests/generators/test_generator_vllm.py."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from asyncrl.generators.engine import Engine, Sampling, StepOutput
from asyncrl.generators.prompts import Prompt
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

    def add_request(self, request_id, prompt, sampling, images=()):
        assert sampling.n == 1 or self.multi_sample, "n samples asked of an engine without multi_sample"
        self.live[request_id] = [list(prompt), sampling.max_new_tokens, 0, set(range(sampling.n))]
        self.added.append((request_id, list(prompt), sampling.n))

    def step(self):
        self.steps += 1
        outs = []
        for rid, req in list(self.live.items()):
            req[2] += 1
            for i in sorted(req[3]):  # sample i of an n-sample request stops i tokens early
                done = req[2] >= req[1] - i
                reason = "stop" if i else "length"
                outs.append(StepOutput(rid, [100 * self.loaded + req[2]], [-float(self.loaded)], done, reason, i))
                if done:
                    req[3].discard(i)
            if not req[3]:
                del self.live[rid]
        return outs

    def abort_requests(self, request_ids):
        self.aborted += request_ids
        for rid in request_ids:
            self.live.pop(rid, None)

    def load_weights(self, tensors):
        self.loaded = tensors["v"]


class MultiCountingEngine(CountingEngine):
    multi_sample = True


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

    def probe_for(self, update):
        return self.probe_ids

    def newer(self, timeout_ms: int = 0):
        if self.version < self.v and self.engine.steps >= self.at:
            return Update(self.v, {"v": self.v})
        return None

    def engine_tensors(self, update):
        return update.tensors  # a full version, no tied names

    def applied(self, update, seconds, probe=None, routing=None, probe_to_come=False, held_seconds=0.0):
        self.version = update.version
        self.held_seconds = held_seconds


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


def under_a_waiting_update(then):
    """A ``wait`` pump whose update (offered at step 1) waits for a first turn still running: ``then(pump)``
    awaited at step 2; (the first turn's completion, what ``then`` returned)."""
    engine = CountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=1), "wait")

    async def scenario():
        runner = asyncio.create_task(pump.run())
        first = asyncio.create_task(pump.complete([1], SAMPLING))
        while engine.steps < 2:
            await asyncio.sleep(0)
        try:
            got = await then(pump)
            return await first, got
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    return asyncio.run(scenario())


def test_wait_finishes_running_turns_first_and_starts_no_new_one_meanwhile():
    a, b = under_a_waiting_update(lambda pump: pump.complete([2], SAMPLING))  # asks while the update waits
    assert a.versions == [0, 0, 0, 0] and b.versions == [1, 1, 1, 1]


def test_under_wait_a_held_back_update_is_the_version_new_turns_get_and_lands_before_a_hold():
    """Admission keys on ``next_version`` (the waiting update's: turns queued now start after it loads),
    and a hold entered meanwhile waits for it to land (held first, it never would: a deadlock)."""

    async def hold_and_ask(pump):
        waiting = (pump.version, pump.next_version)
        async with pump.hold():
            return waiting, await asyncio.wait_for(pump.complete([2], SAMPLING), 30)

    _, (waiting, held) = under_a_waiting_update(hold_and_ask)
    assert waiting == (0, 1) and held.versions == [1, 1, 1, 1]


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
    assert feed.held_seconds > 0  # version 1 came at the hold's first step and waited for its end


def test_an_update_that_no_hold_kept_waiting_says_it_waited_for_none():
    engine = CountingEngine()
    feed = ScriptedFeed(engine, at=2)
    asyncio.run(run_turns(EnginePump(engine, feed, "continue"), [[9]]))
    assert feed.version == 1 and feed.held_seconds == 0.0


def cancel_after_three_steps(engine: CountingEngine, pump: EnginePump, ask) -> None:
    """Run ``ask()`` (a turn that would never end) for three engine steps, cancel it, and wait until the
    engine holds no request."""

    async def scenario():
        runner = asyncio.create_task(pump.run())
        asked = asyncio.create_task(ask())
        while engine.steps < 3:
            await asyncio.sleep(0)
        asked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asked
        while engine.live:
            await asyncio.sleep(0)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(scenario())


def test_a_cancelled_turn_is_aborted_in_the_engine():
    engine = CountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=10**9), "wait")
    cancel_after_three_steps(engine, pump, lambda: pump.complete([1], Sampling(1, 1.0, 1.0, 10**6)))
    assert len(engine.aborted) == 1 and not engine.live


def test_turns_are_batched_as_they_come_and_the_engine_idles_without_any():
    engine = CountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=10**9), "wait")
    comps = asyncio.run(run_turns(pump, [[i] for i in range(5)]))
    assert engine.steps == 4 and all(c.tokens == [1, 2, 3, 4] for c in comps)  # one batch of 5
    assert pump.take_idle_fraction() is not None
    assert pump.take_batch_stats() == {"engine/steps": 4, "engine/batch_mean": 5.0}
    assert pump.take_batch_stats() == {"engine/steps": 0}  # taken: the next report's count starts at 0


# -- n samples of one prompt ------------------------------------------------------------------------------
async def run_many(pump: EnginePump, prompt: list[int], n: int, sampling=SAMPLING):
    runner = asyncio.create_task(pump.run())
    try:
        return await pump.complete_many(prompt, sampling, n)
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


def test_n_samples_of_one_prompt_are_one_request_each_reported_by_its_index():
    engine = MultiCountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=10**9), "continue")
    comps = asyncio.run(run_many(pump, [9], 3))
    assert engine.added == [("turn-0", [9], 3)] and engine.steps == 4
    assert [c.tokens for c in comps] == [[1, 2, 3, 4], [1, 2, 3], [1, 2]]  # sample i stopped i early
    assert [c.finish_reason for c in comps] == ["length", "stop", "stop"]
    assert all(c.versions == [0] * len(c.tokens) for c in comps) and not pump._live


def test_an_engine_without_multi_sample_gets_n_requests():
    engine = CountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=10**9), "continue")
    comps = asyncio.run(run_many(pump, [9], 3))
    assert [(p, n) for _, p, n in engine.added] == [([9], 1)] * 3 and engine.steps == 4
    assert all(c.tokens == [1, 2, 3, 4] for c in comps)


def test_continue_splits_a_running_n_sample_request_per_sample():
    """At the update the request is aborted; each unfinished sample goes on alone from its own tokens
    (their new tokens of the new version), a sample that had finished keeps its completion."""
    engine = MultiCountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=2), "continue")
    a, b, c = asyncio.run(run_many(pump, [9], 3))
    assert engine.aborted == ["turn-0"]
    assert engine.added[1:] == [("turn-1", [9, 1, 2], 1), ("turn-2", [9, 1, 2], 1)]
    assert c.tokens == [1, 2] and c.versions == [0, 0] and c.finish_reason == "stop"  # done before the update
    for x in (a, b):
        assert x.tokens == [1, 2, 101, 102] and x.versions == [0, 0, 1, 1] and x.logprobs == [0, 0, -1, -1]


def test_abort_restarts_the_unfinished_samples_of_an_n_sample_request():
    engine = MultiCountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=2), "abort")
    a, b, c = asyncio.run(run_many(pump, [9], 3))
    assert engine.added[1:] == [("turn-1", [9], 1), ("turn-2", [9], 1)]
    assert c.tokens == [1, 2] and c.versions == [0, 0]
    assert a.tokens == b.tokens == [101, 102, 103, 104] and a.versions == b.versions == [1] * 4


def test_wait_lets_an_n_sample_request_finish_under_its_version():
    engine = MultiCountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=1), "wait")

    async def scenario():
        runner = asyncio.create_task(pump.run())
        first = await pump.complete_many([1], SAMPLING, 2)
        second = await pump.complete_many([2], SAMPLING, 2)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        return first, second

    first, second = asyncio.run(scenario())
    assert [c.versions for c in first] == [[0] * 4, [0] * 3] and [c.versions for c in second] == [[1] * 4, [1] * 3]
    assert engine.aborted == [] and [n for *_, n in engine.added] == [2, 2]


def test_a_cancelled_n_sample_request_is_aborted_whole():
    engine = MultiCountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=10**9), "continue")
    cancel_after_three_steps(engine, pump, lambda: pump.complete_many([1], Sampling(1, 1.0, 1.0, 10**6), 4))
    assert engine.aborted == ["turn-0"] and not engine.live and not pump._live


def test_single_turns_and_n_sample_requests_share_the_steps():
    engine = MultiCountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=10**9), "continue")

    async def scenario():
        runner = asyncio.create_task(pump.run())
        try:
            return await asyncio.gather(pump.complete([5], SAMPLING), pump.complete_many([6], SAMPLING, 2))
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    single, many = asyncio.run(scenario())
    assert engine.steps == 4 and single.tokens == [1, 2, 3, 4] and [c.tokens for c in many] == [[1, 2, 3, 4], [1, 2, 3]]


def test_a_groups_single_turns_share_one_n_sample_request():
    """GroupTurns: the n episodes' first turns are one request; a turn of another context or limit, and one
    past the n-th, are requests of their own; one episode's cancellation leaves its siblings' samples."""
    from asyncrl.generators.scheduler import GroupTurns

    engine = MultiCountingEngine()
    pump = EnginePump(engine, ScriptedFeed(engine, at=10**9), "continue")

    async def scenario():
        runner = asyncio.create_task(pump.run())
        shared = GroupTurns(pump, Prompt([9]), SAMPLING, 3)
        try:
            quitter = asyncio.create_task(shared([9], 4))
            firsts = [asyncio.create_task(shared([9], 4)) for _ in range(2)]
            while engine.steps < 1:
                await asyncio.sleep(0)
            quitter.cancel()
            others = await asyncio.gather(shared([9, 1], 4), shared([9], 2), shared([9], 4))
            return await asyncio.gather(*firsts), others, quitter.cancelled()
        finally:
            shared.cancel()
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    firsts, others, quit = asyncio.run(scenario())
    assert quit and engine.added[0] == ("turn-0", [9], 3)
    assert sorted((p, n) for _, p, n in engine.added[1:]) == [([9], 1), ([9], 1), ([9, 1], 1)]
    assert [c.tokens for c in firsts] == [[1, 2, 3], [1, 2]]  # samples 1 and 2: sample 0 was the quitter's
    assert [len(c.tokens) for c in others] == [4, 2, 4] and engine.aborted == []


class ScoringEngine(CountingEngine):
    """Scores a started probe (each token's log-prob: minus the weights loaded) in its ``score_steps``-th
    step, alongside the requests; ``probe_steps`` counts the steps that ran it."""

    scores_alongside = True

    def __init__(self, score_steps: int = 1):
        super().__init__()
        self.score_steps, self.scoring, self.scored, self.probe_steps = score_steps, None, None, 0

    def start_score(self, ids):
        self.scoring = [list(ids), 0]

    def step(self):
        if self.scoring is not None:
            self.probe_steps += 1
            self.scoring[1] += 1
            if self.scoring[1] == self.score_steps:
                self.scored, self.scoring = [-float(self.loaded)] * (len(self.scoring[0]) - 1), None
        return super().step()

    def take_score(self):
        scored, self.scored = self.scored, None
        return scored

    def abort_score(self):
        had, self.scoring, self.scored = self.scoring is not None or self.scored is not None, None, None
        return had


class ProbedFeed(ScriptedFeed):
    """A scripted feed with a probe: what the pump told it, in order."""

    def __init__(self, engine, at, v=1):
        super().__init__(engine, at, v)
        self.probe_ids, self.told = [5, 6, 7], []

    def applied(self, update, seconds, probe=None, routing=None, probe_to_come=False, held_seconds=0.0):
        super().applied(update, seconds)
        self.told.append(("applied", update.version, probe_to_come))

    def probed(self, probe):
        self.told.append(("probed", self.version, probe))


def test_the_probe_is_scored_in_the_next_step_with_the_turns():
    """No step of its own: the step after the load runs the probe and the turns, and the feed gets the
    log-probs of the loaded weights."""
    engine = ScoringEngine()
    feed = ProbedFeed(engine, at=2)
    (c,) = asyncio.run(run_turns(EnginePump(engine, feed, "continue"), [[9]]))
    assert c.versions == [0, 0, 1, 1]
    assert engine.steps == 4 and engine.probe_steps == 1
    assert feed.told == [("applied", 1, True), ("probed", 1, [-1.0, -1.0])]


def test_an_idle_pump_steps_for_the_probe_alone():
    engine = ScoringEngine()
    feed = ProbedFeed(engine, at=0)

    async def scenario():
        pump = EnginePump(engine, feed, "continue")
        runner = asyncio.create_task(pump.run())
        while len(feed.told) < 2:
            await asyncio.sleep(0.01)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert feed.told == [("applied", 1, True), ("probed", 1, [-1.0, -1.0])] and engine.steps == 1


def test_a_probe_not_scored_before_the_next_load_is_dropped_not_mixed():
    """A probe still unscored when the next version loads (here it takes two steps) would see two versions'
    weights: it leaves the engine and its version's record goes out without it."""
    engine = ScoringEngine(score_steps=2)
    feed = ProbedFeed(engine, at=1, v=1)
    versions = iter([1, 2])

    def newer(timeout_ms=0):  # version 1 after step 1, version 2 after step 2
        if engine.steps >= feed.version + 1 and feed.version < 2:
            v = next(versions)
            return Update(v, {"v": v})
        return None

    feed.newer = newer
    (c,) = asyncio.run(run_turns(EnginePump(engine, feed, "continue"), [[9]]))
    assert c.versions == [0, 1, 2, 2]
    assert feed.told == [("applied", 1, True), ("probed", 1, None), ("applied", 2, True), ("probed", 2, [-2.0, -2.0])]
