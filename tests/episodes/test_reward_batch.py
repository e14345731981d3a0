"""Rewards asked in one turn of the event loop go to the worker pool as one call (``user_code.RewardBatch``), with
real worker processes: the answers are each call's own, and no outcome differs from the unbatched one --
an error, a result that is not JSON, a hang. Timeouts here only decide which calls hang, with wide margins."""

from __future__ import annotations

import asyncio
import math
import re
import subprocess
import sys
from pathlib import Path

import pool_targets
import pytest
from pool_fixtures import in_pool

from asyncrl.episodes.user_code import RewardBatch, caller
from asyncrl.errors import EpisodeFailure
from asyncrl.rewards.batch import each

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 30.0
HANG_S = 2.0  # the hanging reward's timeout; it sleeps 60 s


async def outcome(call, completion: str, timeout_s: float = WAIT_S):
    """The reward's answer, or ``(cause, detail)`` of its failure."""
    try:
        return await call(pool_targets.reward, timeout_s, "p", completion, {"bonus": 10})
    except EpisodeFailure as failure:
        return failure.cause, re.sub(r"pid \d+", "pid N", failure.detail)  # a killed worker's pid: any


def test_rewards_asked_in_one_turn_are_one_call_and_each_gets_its_own_answer():
    """A target's first turn sends its calls in batches of FIRST (one call each); once a batch was fast (here:
    any batch is), a turn's calls are one call, each with its own answer."""

    async def test(pool):
        batch = RewardBatch(pool, "reward", slow_s=math.inf)
        target, first = "pool_targets:reward", RewardBatch.FIRST

        async def turn(n: int) -> list:
            return await asyncio.gather(*(batch.call(target, ["p", "x" * i, {"bonus": 10}], WAIT_S) for i in range(n)))

        assert await turn(20) == [10 + i for i in range(20)]
        assert pool.stats()["calls"] == 20 // first and batch.fast == {target: True}
        assert await turn(20) == [10 + i for i in range(20)]
        assert pool.stats()["calls"] == 1 + 20 // first
        assert await turn(3) == [10, 11, 12] and pool.stats()["calls"] == 2 + 20 // first  # the next turn: another
        unbatched = caller(pool, "reward")
        await asyncio.gather(*(outcome(unbatched, "x") for _ in range(4)))
        assert pool.stats()["calls"] == 6 + 20 // first

    in_pool(test, workers=2, threads=4)


def test_a_first_burst_takes_one_worker_not_the_pool():
    """Forty rewards in the first turn (an evaluation's burst), their speed not yet known: ten batches of FIRST,
    on one worker's threads; alone, 36 of them took a thread each and started three more workers."""

    async def test(pool):
        batch = RewardBatch(pool, "reward", slow_s=math.inf)
        asks = [batch.call("pool_targets:reward", ["p", "x" * i, {"bonus": 1}], WAIT_S) for i in range(40)]
        assert await asyncio.gather(*asks) == [1 + i for i in range(40)]
        stats = pool.stats()
        assert stats["calls"] == 40 // RewardBatch.FIRST and stats["workers_started"] == 1, stats

    in_pool(test, workers=4, threads=16)


def test_a_slow_reward_goes_alone_after_its_first_batch():
    """Batched, calls run one after another in a worker: a reward slower than slow_s a call (it sleeps 0.2 s)
    is batched once, then its calls go alone, side by side on the pool's threads."""

    async def test(pool):
        batch = RewardBatch(pool, "reward")
        target = "pool_targets:reward"
        for _ in range(2):
            answers = await asyncio.gather(*(batch.call(target, ["p", "nap", {"bonus": 1}], WAIT_S) for _ in range(4)))
            assert answers == [4] * 4
        assert batch.fast == {target: False} and pool.stats()["calls"] == 1 + 4

    in_pool(test, workers=2, threads=4)


@pytest.mark.parametrize("odd", ["raise", "set", "hang"])
def test_a_batch_never_changes_an_outcome(odd):
    """One odd reward among good ones: batched, every call ends as it does unbatched (the odd one with its own
    cause and detail, the good ones with their scores), the batch run again call by call."""

    async def test(pool):
        completions = ["a", odd, "bb", "ccc"]
        timeout = HANG_S if odd == "hang" else WAIT_S
        batched = await asyncio.gather(*(outcome(caller(pool, "reward", True), c, timeout) for c in completions))
        alone = [await outcome(caller(pool, "reward"), c, timeout) for c in completions]
        assert batched == alone
        assert batched[0] == 11 and batched[2] == 12 and batched[3] == 13
        assert batched[1][0] == {"raise": "reward_error", "set": "reward_error", "hang": "reward_timeout"}[odd]

    in_pool(test, workers=2, threads=4)


def test_a_cancelled_asker_leaves_the_others_their_answers():
    async def test(pool):
        call = caller(pool, "reward", batched=True)
        tasks = [asyncio.ensure_future(outcome(call, "x" * i)) for i in range(4)]
        await asyncio.sleep(0)  # each has asked
        tasks[1].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(done[1], asyncio.CancelledError) and [done[0], *done[2:]] == [10, 12, 13]

    in_pool(test, workers=2, threads=4)


def test_each_scores_in_order_and_marks_what_raised():
    done = each("pool_targets:reward", [["p", "ab", {"bonus": 1}], ["p", "raise", {}]])
    assert done["results"] == [[True, 3], [False, None]] and done["seconds"] >= 0


@pytest.mark.redis
def test_the_episode_overhead_bench_measures_both_sides():
    """scripts/bench/episode_overhead.py, briefly: it runs and prints its figures for both configurations."""
    cmd = [sys.executable, "scripts/bench/episode_overhead.py", "--rounds", "1", "--groups", "16"]
    out = subprocess.run([*cmd, "--set", "episode.batch_rewards=false"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    results = dict(line.split()[1:3] for line in out.stdout.splitlines() if line.startswith("RESULT "))
    assert set(results) == {"generator_cpu_ms_per_group", "pool_cpu_ms_per_group", "cpu_per_group_over_overrides"}
    assert float(results["generator_cpu_ms_per_group"]) > 0 and float(results["cpu_per_group_over_overrides"]) > 0
    assert float(results["pool_cpu_ms_per_group"]) >= 0  # the workers' CPU is read in clock ticks: 16 groups, maybe 0
