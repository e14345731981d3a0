"""The SmolLM2 task (asyncrl.demo.arith): its reward, its shipped data, and that its records are chat
messages the data loader accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.data import load_jsonl
from asyncrl.demo import arith

DATA = Path(__file__).resolve().parents[2] / "data" / "arith"
REC = {"messages": [{"role": "user", "content": arith.QUESTION.format(a=7, b=15)}], "answer": "22"}


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("22", 1.0),
        (" 22.\n", 1.0),
        ("22\nbecause 7 + 15 = 22", 1.0),  # only the first line counts
        ("7 + 15 = 22", arith.RIGHT_BUT_WORDY),
        ("The answer is 22.", arith.RIGHT_BUT_WORDY),
        ("22 is 7 + 15", 0.0),  # the line's last number is not the answer
        ("23", 0.0),
        ("", 0.0),
        ("\n22", 1.0),  # leading blank lines are stripped
        ("I think\n22", 0.0),
    ],
)
def test_reward_pays_the_bare_answer_fully_and_a_wordy_right_one_in_part(completion, expected):
    assert arith.reward("", completion, REC) == expected


def test_data_files_are_chat_records_disjoint_and_reproducible():
    train = [json.loads(line) for line in (DATA / "train.jsonl").read_text().splitlines()]
    held_out = [json.loads(line) for line in (DATA / "eval.jsonl").read_text().splitlines()]
    assert (len(train), len(held_out)) == (arith.N_TRAIN, arith.N_EVAL)
    for rec in train + held_out:
        (message,) = rec["messages"]
        a, b = (int(x) for x in message["content"].removeprefix("What is ").split("?")[0].split(" + "))
        assert message == {"role": "user", "content": arith.QUESTION.format(a=a, b=b)}
        assert rec["answer"] == str(a + b) and 1 <= min(a, b) <= max(a, b) <= arith.MAX_OPERAND
    questions = [r["messages"][0]["content"] for r in train]
    assert len(set(questions)) == len(questions)
    assert not set(questions) & {r["messages"][0]["content"] for r in held_out}
    assert (train, held_out) == arith.make_splits(arith.N_TRAIN, arith.N_EVAL, arith.DATA_SEED)
    assert len(load_jsonl(str(DATA / "eval.jsonl"))) == arith.N_EVAL  # valid chat records


def test_more_records_than_distinct_questions_is_an_error():
    with pytest.raises(ValueError, match="distinct questions"):
        arith.make_splits(arith.MAX_OPERAND**2, 1, 0)
