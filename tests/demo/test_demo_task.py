"""The demo task (sort letters), its shipped data, and the demo tokenizer and model recipe."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.demo import sort

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "sort"


def _load(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


# --- reward --------------------------------------------------------------------------------------

REC = {"prompt": "sort:dbca=", "answer": "abcd"}


def test_reward_exact_answer_is_one_and_empty_is_zero():
    assert sort.reward(REC["prompt"], "abcd", REC) == 1.0
    assert sort.exact("abcd", REC)
    assert sort.reward(REC["prompt"], "", REC) == 0.0
    assert not sort.exact("", REC)


@pytest.mark.parametrize("completion", ["abdc", "bcd", "abc", "dcba", "dbca", "abcde", "abcdabcd", "zzzz"])
def test_reward_partial_answers_score_strictly_between(completion):
    r = sort.reward(REC["prompt"], completion, REC)
    assert 0.0 <= r < 1.0
    if completion != "zzzz":  # shares letters with the answer
        assert r > 0.0


def test_reward_orders_closer_answers_higher():
    score = lambda c: sort.reward(REC["prompt"], c, REC)  # noqa: E731
    assert score("abcd") > score("abdc") > score("dcba") > score("zzzz")
    assert score("abcd") > score("abc") > score("ab")


@given(st.text(alphabet="abcdefghijklmnop=: xyz", max_size=20), st.integers(0, 10_000))
def test_reward_is_in_unit_interval_and_one_only_when_exact(completion, seed):
    rec = sort.make_record(random.Random(seed))
    r = sort.reward(rec["prompt"], completion, rec)
    assert 0.0 <= r <= 1.0
    assert (r == 1.0) == sort.exact(completion, rec)


@given(st.integers(0, 10_000), st.text(alphabet="abcdefghijklmnop ", min_size=1, max_size=8))
def test_reward_appending_to_the_answer_never_helps(seed, tail):
    rec = sort.make_record(random.Random(seed))
    assert sort.reward(rec["prompt"], rec["answer"] + tail, rec) < 1.0


# --- data ----------------------------------------------------------------------------------------


def test_data_files_are_well_formed_disjoint_and_reproducible():
    train, held_out = _load("train.jsonl"), _load("eval.jsonl")
    assert (len(train), len(held_out)) == (sort.N_TRAIN, sort.N_EVAL)
    for rec in train + held_out:
        assert set(rec) == {"prompt", "answer"}
        assert rec["prompt"].startswith(sort.PREFIX) and rec["prompt"].endswith(sort.SUFFIX)
        letters = rec["prompt"][len(sort.PREFIX) : -len(sort.SUFFIX)]
        assert sort.MIN_LEN <= len(letters) <= sort.MAX_LEN
        assert set(letters) <= set(sort.ALPHABET)
        assert rec["answer"] == "".join(sorted(letters))
    train_prompts = {r["prompt"] for r in train}
    assert len(train_prompts) == len(train)
    assert not train_prompts & {r["prompt"] for r in held_out}
    assert (train, held_out) == sort.make_splits(sort.N_TRAIN, sort.N_EVAL, sort.DATA_SEED)
    assert sum((DATA / f).stat().st_size for f in ("train.jsonl", "eval.jsonl")) < 300_000


# --- tokenizer -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from asyncrl.demo.model import build_tokenizer

    return build_tokenizer()


def test_tokenizer_is_byte_level_and_round_trips(tokenizer):
    ids = tokenizer.encode("abcd")
    assert len(ids) == 4
    assert tokenizer.decode(ids) == "abcd"
    for text in ["sort:dbca=", "a b", "é✓", "\n\t"]:
        ids = tokenizer.encode(text)
        assert len(ids) == len(text.encode())
        assert tokenizer.decode(ids) == text
    # No special tokens are ever added: HF, vLLM and the learner tokenize prompts identically.
    assert tokenizer.encode("sort:ab=", add_special_tokens=True) == tokenizer.encode(
        "sort:ab=", add_special_tokens=False
    )
    eos = tokenizer.eos_token_id
    assert tokenizer.decode(tokenizer.encode("abcd") + [eos], skip_special_tokens=True) == "abcd"
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, eos}) == 3


def test_tokenizer_save_and_load_with_auto_tokenizer(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == len(tokenizer)
    text = "sort:pjhcb=bchjp"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        assert getattr(loaded, name) == getattr(tokenizer, name)


def test_greedy_eval_on_an_untrained_model(tokenizer):
    import torch

    from asyncrl.demo.model import build_model, greedy_eval

    torch.set_num_threads(1)
    scores = greedy_eval(build_model(tokenizer, seed=0), tokenizer, _load("eval.jsonl")[:16], max_new_tokens=4)
    assert set(scores) == {"reward_mean", "exact_rate"}
    assert 0.0 <= scores["reward_mean"] < 0.5 and scores["exact_rate"] == 0.0


# --- the demo model recipe -----------------------------------------------------------------------


@pytest.mark.slow
def test_prepare_demo_model_builds_a_partial_policy_once(tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from asyncrl.demo.model import RECIPE_FILE, greedy_eval
    from asyncrl.demo.recipes import prepare_demo_model

    torch.set_num_threads(1)
    path = tmp_path / "demo"
    assert prepare_demo_model(path, seed=0, log=lambda _: None) == path
    config = AutoConfig.from_pretrained(path)
    assert config.head_dim >= 32  # vLLM's CPU attention refuses head_dim 16
    assert config.hidden_size // config.num_attention_heads >= 32
    recipe = json.loads((path / RECIPE_FILE).read_text())
    assert recipe["recipe"] == "demo-sort" and recipe["seed"] == 0
    assert 0.1 <= recipe["eval_reward"] <= 0.4  # partial: RL has to do the rest
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp dir left behind

    model = AutoModelForCausalLM.from_pretrained(path)
    scores = greedy_eval(model, AutoTokenizer.from_pretrained(path), _load("eval.jsonl"))
    assert scores["reward_mean"] == pytest.approx(recipe["eval_reward"], abs=1e-6)

    logs: list[str] = []
    assert prepare_demo_model(path, seed=0, log=logs.append) == path  # cached: returns at once
    assert len(logs) == 1 and "cached" in logs[0]
