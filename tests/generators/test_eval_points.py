"""Which version a generator evaluates (issue 25): the first version it serves at or after each eval point,
even when versions pass faster than it applies them (it skips from 9 to 11: point 10 is evaluated at 11,
and it says so), once across the fleet."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from asyncrl.episodes.api import Outcome
from asyncrl.generators.evaluation import HeldOut, eval_points, eval_record, points_reached
from asyncrl.generators.generator import Generator


def test_eval_points_are_the_first_version_every_eval_every_and_the_last():
    assert eval_points(40, 10) == {0, 10, 20, 30, 40}
    assert eval_points(40, 0) == {0, 40}
    assert eval_points(25, 10) == {0, 10, 20, 25}


def test_the_points_reached_are_those_at_or_below_the_served_version():
    assert points_reached({10, 20, 40}, 9) == []
    assert points_reached({10, 20, 40}, 10) == [10]
    assert points_reached({10, 20, 40}, 11) == [10]  # 10 was never served here: evaluated at 11
    assert points_reached({10, 20, 40}, 25) == [10, 20]
    assert points_reached(set(), 25) == []


class Claims:
    """``RunControl.claim_once`` across a fleet: each name once."""

    def __init__(self, *taken: str):
        self.taken = set(taken)

    def claim_once(self, name: str) -> bool:
        if name in self.taken:
            return False
        self.taken.add(name)
        return True


def generator_at(version: int, due: set[int], claims: Claims) -> tuple[SimpleNamespace, list]:
    """What ``Generator.maybe_evaluate`` reads of a generator serving ``version``; the evaluations it starts."""
    started: list = []

    async def evaluate(points: list[int] | None = None) -> None:
        started.append((version, points))

    gen = SimpleNamespace(
        version=version, due_evals=set(due), eval_sets=[SimpleNamespace(episodes=[object()])], evaluating=None,
        control=claims,
        evaluate=evaluate, _task_done=lambda task: None,
    )  # fmt: skip
    return gen, started


def decide(gen: SimpleNamespace) -> None:
    """One tick's decision, and the evaluation it started run to its end."""

    async def tick() -> None:
        Generator.maybe_evaluate(gen)
        if gen.evaluating is not None:
            await gen.evaluating

    asyncio.run(tick())


def test_a_skipped_eval_point_is_evaluated_at_the_first_version_served_after_it_and_said(caplog):
    claims = Claims("eval:0")
    gen, started = generator_at(11, {10, 20, 40}, claims)
    with caplog.at_level(logging.INFO, logger="asyncrl.generator"):
        decide(gen)
    assert started == [(11, [10])]
    assert claims.taken == {"eval:0", "eval:10"} and gen.due_evals == {20, 40}
    said = [r.getMessage() for r in caplog.records]
    assert any("eval point 10" in m and "version 11" in m for m in said), said


def test_two_points_passed_at_once_are_one_evaluation_of_the_served_version():
    claims = Claims()
    gen, started = generator_at(21, {10, 20, 40}, claims)
    decide(gen)
    assert started == [(21, [10, 20])] and claims.taken == {"eval:10", "eval:20"} and gen.due_evals == {40}


def test_a_point_another_generator_claimed_is_not_evaluated_twice():
    claims = Claims("eval:10")
    gen, started = generator_at(12, {10, 20, 40}, claims)
    decide(gen)
    assert started == [] and gen.due_evals == {20, 40}


def test_a_point_served_exactly_is_evaluated_there(caplog):
    gen, started = generator_at(10, {10, 20}, Claims())
    with caplog.at_level(logging.INFO, logger="asyncrl.generator"):
        decide(gen)
    assert started == [(10, [10])]
    assert not [r for r in caplog.records if "eval point" in r.getMessage()]  # nothing to explain


def test_nothing_is_decided_while_an_evaluation_runs_or_before_a_point():
    gen, started = generator_at(25, {10, 20}, Claims())
    gen.evaluating = object()
    decide_without_waiting = Generator.maybe_evaluate
    decide_without_waiting(gen)
    assert gen.due_evals == {10, 20} and started == []
    gen, started = generator_at(9, {10, 20}, Claims())
    decide(gen)
    assert started == [] and gen.due_evals == {10, 20}


def test_the_eval_record_names_the_version_evaluated_and_its_point():
    played = [
        (SimpleNamespace(turns=1), Outcome({"reward": 1.0})),
        (SimpleNamespace(turns=1), Outcome({"reward": 0.5})),
        (SimpleNamespace(turns=3), Outcome(None, cause="budget")),  # the policy's fault: scores 0
        (SimpleNamespace(turns=1), Outcome(None, cause="env_error")),  # not the policy's: left out
    ]
    one = [HeldOut("", 0, None, [()] * 4)]  # data.eval as one source: an unnamed set
    record = eval_record(12, [10], one, played, seconds=2.0)
    assert record["eval/version"] == 12 and record["eval/point"] == 10 and "eval/points" not in record
    assert record["eval/reward_mean"] == 0.5 and record["eval/exact_rate"] == 1 / 3
    assert record["eval/failed"] == 2 and record["eval/turns_mean"] == 1.5 and record["eval/seconds"] == 2.0
    two = eval_record(21, [10, 20], one, played, seconds=2.0)  # points passed together: one evaluation of both
    assert two["eval/point"] == 20 and two["eval/points"] == [10, 20]


def episode(reward: float | None, cause: str | None = None, turns: int = 1) -> tuple:
    return SimpleNamespace(turns=turns), Outcome(None if reward is None else {"reward": reward}, cause=cause)


def test_named_sets_report_greedy_mean_at_k_and_pass_at_k_each_and_the_first_is_the_bar():
    # gsm: 2 prompts, greedy then 3 samples each; arith: 2 prompts, greedy only
    gsm = HeldOut("gsm", 3, None, [()] * 8)
    arith = HeldOut("arith", 0, None, [()] * 2)
    played = [
        episode(1.0), episode(0.0),  # gsm greedy
        episode(0.0), episode(1.0), episode(0.5),  # gsm prompt 0's samples: one exactly right
        episode(0.0), episode(None, "env_error"), episode(0.2),  # prompt 1's: none right, one failed (left out)
        episode(0.25), episode(0.75, turns=3),  # arith greedy
    ]  # fmt: skip
    record = eval_record(5, [5], [gsm, arith], played, seconds=1.0)
    assert record["eval/gsm/reward_mean"] == 0.5 and record["eval/gsm/exact_rate"] == 0.5
    assert record["eval/gsm/mean@3"] == (0.5 + 0.1) / 2 and record["eval/gsm/pass@3"] == 0.5
    assert record["eval/gsm/failed"] == 1 and record["eval/arith/failed"] == 0
    assert record["eval/arith/reward_mean"] == 0.5 and "eval/arith/pass@0" not in record
    assert record["eval/arith/turns_mean"] == 2.0
    # the bar: the first set's greedy figures, under the names every sink and summary.json read
    assert record["eval/bar"] == "gsm" and record["eval/reward_mean"] == 0.5 and record["eval/exact_rate"] == 0.5
    assert record["eval/failed"] == 1


def test_a_prompt_whose_every_sample_failed_is_left_out_of_pass_at_k():
    held = HeldOut("s", 2, None, [()] * 6)
    played = [episode(0.0), episode(0.0), episode(1.0), episode(0.0), *[episode(None, "env_error")] * 2]
    record = eval_record(0, [0], [held], played, seconds=1.0)
    assert record["eval/s/pass@2"] == 1.0 and record["eval/s/mean@2"] == 0.5
