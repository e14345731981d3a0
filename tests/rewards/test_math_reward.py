"""``asyncrl.rewards.math_answer``: known verdicts on answer pairs, failures that are not zeros, and the
reward served by a real ``asyncrl reward-serve``.

``tests/data/math_answers.jsonl``: one ``{"answer", "completion", "correct", "kind"}`` per line;
``kind`` says what the pair exercises (equivalent forms, boxed answers, sets, intervals, wrong
answers, completions without an answer).
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from test_reward_serve import start_reward_serve

from asyncrl.errors import EpisodeFailure
from asyncrl.rewards.math_answer import math_reward
from asyncrl.rewards.remote import RemoteReward
from asyncrl.rewards.resolve import score

PAIRS = [
    json.loads(line) for line in (Path(__file__).parents[1] / "data" / "math_answers.jsonl").read_text().splitlines()
]


def test_fixture_is_broad():
    assert len(PAIRS) >= 50
    verdicts = [p["correct"] for p in PAIRS]
    assert verdicts.count(True) >= 20 and verdicts.count(False) >= 15


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{i}-{p['kind']}" for i, p in enumerate(PAIRS)])
def test_verdicts(pair: dict):
    assert math_reward("prompt", pair["completion"], {"answer": pair["answer"]}) == float(pair["correct"])


def test_runs_off_the_main_thread():
    """No signal-based timeouts: math-verify's would raise on a worker thread."""
    got: list[float] = []
    thread = threading.Thread(target=lambda: got.append(math_reward("p", "$\\boxed{0.5}$", {"answer": "1/2"})))
    thread.start()
    thread.join()
    assert got == [1.0]


@pytest.mark.parametrize(
    ("record", "error"),
    [({}, KeyError), ({"answer": ""}, ValueError), ({"answer": None}, TypeError), ({"answer": True}, TypeError)],
)
def test_bad_records_raise_and_are_never_zero(record: dict, error: type[Exception]):
    with pytest.raises(error):
        math_reward("p", "$\\boxed{1}$", record)
    with pytest.raises(EpisodeFailure) as failed:
        asyncio.run(score(math_reward, "p", "$\\boxed{1}$", record, 60))
    assert failed.value.cause == "reward_error"


def test_through_reward_serve(tmp_path: Path):
    server = start_reward_serve(
        tmp_path, "asyncrl.rewards.math_answer:math_reward", "--workers", "1", "--deadline-s", "60"
    )
    try:

        async def main():
            async with RemoteReward(server.token_url, timeout_s=90) as rr:
                right = await rr("p", "so $\\boxed{\\frac{1}{2}}$", {"answer": "0.5"})
                wrong = await rr("p", "so $\\boxed{3}$", {"answer": "0.5"})
                with pytest.raises(EpisodeFailure) as failed:
                    await rr("p", "so $\\boxed{3}$", {"question": "no answer"})
            return right, wrong, failed.value

        right, wrong, failure = asyncio.run(main())
    finally:
        server.stop()
    assert (right, wrong) == (1.0, 0.0)
    assert failure.cause == "reward_error" and "KeyError" in failure.detail
