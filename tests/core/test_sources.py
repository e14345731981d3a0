"""Prompt sources (issue 49): the files and datasets users keep their prompts in, their columns mapped to
records, and mixtures of them drawn in an order that a resume continues exactly."""

from __future__ import annotations

import collections
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.config.data import DataConfig, SourceConfig
from asyncrl.data import prompt_for_sequence
from asyncrl.data.sources import BLOCK, Mixture, PromptSet, _block_order, apportion
from asyncrl.errors import UserError

QUESTIONS = [f"What is {a} + {b}?" for a in range(1, 6) for b in range(1, 6)]
ANSWERS = [str(a + b) for a in range(1, 6) for b in range(1, 6)]
PAIRS = list(zip(QUESTIONS, ANSWERS, strict=True))


def gsm8k_shaped(tmp_path) -> dict:
    """GSM8K's columns, ``question`` and ``answer``, as Parquet, a save_to_disk directory, JSON, CSV and shards."""
    import datasets

    table = pa.table({"question": QUESTIONS, "answer": ANSWERS})
    pq.write_table(table, tmp_path / "gsm.parquet")
    datasets.Dataset(table).save_to_disk(str(tmp_path / "gsm_disk"))
    (tmp_path / "gsm.json").write_text(json.dumps([{"question": q, "answer": a} for q, a in PAIRS]))
    (tmp_path / "gsm.csv").write_text("question,answer\n" + "".join(f'"{q}",{a}\n' for q, a in PAIRS))
    (tmp_path / "shards").mkdir()
    pq.write_table(table.slice(0, 10), tmp_path / "shards" / "part-0.parquet")
    pq.write_table(table.slice(10), tmp_path / "shards" / "part-1.parquet")
    return {
        "parquet": tmp_path / "gsm.parquet",
        "save_to_disk": tmp_path / "gsm_disk",
        "json": tmp_path / "gsm.json",
        "csv": tmp_path / "gsm.csv",
        "glob": tmp_path / "shards" / "*.parquet",
    }


@pytest.mark.parametrize("form", ["parquet", "save_to_disk", "json", "csv", "glob"])
def test_every_form_gives_the_mapped_records_in_the_sources_order(tmp_path, form):
    prompts = PromptSet(SourceConfig(path=str(gsm8k_shaped(tmp_path)[form]), columns={"prompt": "question"}))
    assert len(prompts) == len(QUESTIONS)
    for i in (0, 7, len(QUESTIONS) - 1):
        record = prompts[i]  # CSV's reader takes the answers for numbers
        assert record == {"question": QUESTIONS[i], "answer": record["answer"], "prompt": QUESTIONS[i]}
        assert str(record["answer"]) == ANSWERS[i]
    assert prompts.where(3).endswith(" row 3") and not prompts.is_jsonl


def test_a_template_makes_the_prompt_and_a_mapped_field_reaches_the_record(tmp_path):
    path = gsm8k_shaped(tmp_path)["parquet"]
    src = SourceConfig(path=str(path), template="{question} Reply with the number only.", columns={"label": "answer"})
    record = PromptSet(src)[2]
    assert record["prompt"] == f"{QUESTIONS[2]} Reply with the number only."
    assert record["label"] == record["answer"] == ANSWERS[2]


def test_a_jsonl_file_is_mapped_too_and_names_its_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in PAIRS))
    prompts = PromptSet(SourceConfig(path=str(path), columns={"prompt": "q"}))
    assert prompts[1] == {"q": QUESTIONS[1], "a": ANSWERS[1], "prompt": QUESTIONS[1]} and prompts.is_jsonl
    assert prompts.where(1) == f"{path}:2"
    with pytest.raises(UserError, match=r"t.jsonl:1: no column 'question' \(columns.prompt\); the columns are a, q"):
        PromptSet(SourceConfig(path=str(path), columns={"prompt": "question"}))


def test_messages_columns_are_chats(tmp_path):
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    pq.write_table(pa.table({"chat": chats, "answer": ANSWERS}), tmp_path / "c.parquet")
    record = PromptSet(SourceConfig(path=str(tmp_path / "c.parquet"), columns={"messages": "chat"}))[4]
    assert record["messages"] == chats[4] and "prompt" not in record


@pytest.mark.parametrize(
    ("make", "columns", "template", "message"),
    [
        (lambda d: pq.write_table(pa.table({"q": ["a"]}), d / "x.parquet"), {"prompt": "question"}, None,
         "no column 'question' (columns.prompt); the columns are q"),
        (lambda d: pq.write_table(pa.table({"q": [1, 2]}), d / "x.parquet"), {"prompt": "q"}, None,
         "column 'q' (the prompt) holds Value('int64'), not strings"),
        (lambda d: pq.write_table(pa.table({"q": ["a", None]}), d / "x.parquet"), {"prompt": "q"}, None,
         "column 'q' has 1 empty (null) values"),
        (lambda d: pq.write_table(pa.table({"q": ["a"]}), d / "x.parquet"), {}, "Q: {question}",
         "the template names {question}, which is no column"),
        (lambda d: pq.write_table(pa.table({"q": ["a"]}), d / "x.parquet"), {}, None,
         "no 'prompt' or 'messages' column; map one"),
        (lambda d: pq.write_table(pa.table({"q": pa.array([], pa.string())}), d / "x.parquet"), {"prompt": "q"}, None,
         "x.parquet has no rows"),
        (lambda d: (d / "x.parquet").write_bytes(b"PAR1 this is no parquet file"), {"prompt": "q"}, None,
         "is not a readable Parquet file"),
        (lambda d: (d / "x.parquet").write_bytes(b""), {"prompt": "q"}, None, "x.parquet is empty"),
    ],
)  # fmt: skip
def test_a_bad_source_is_one_error_naming_it(tmp_path, make, columns, template, message):
    make(tmp_path)
    with pytest.raises(UserError) as err:
        PromptSet(SourceConfig(path=str(tmp_path / "x.parquet"), columns=columns, template=template))
    assert str(err.value).startswith(str(tmp_path / "x.parquet")) and message in str(err.value), err.value


def test_paths_that_name_nothing_readable(tmp_path):
    with pytest.raises(UserError, match="the glob matches no file"):
        PromptSet(SourceConfig(path=str(tmp_path / "*.parquet")))
    with pytest.raises(UserError, match="no such file"):
        PromptSet(SourceConfig(path=str(tmp_path / "absent.parquet")))
    (tmp_path / "plain").mkdir()
    with pytest.raises(UserError, match="save_to_disk did not write; name its files with a glob"):
        PromptSet(SourceConfig(path=str(tmp_path / "plain")))


def test_config_forms_of_a_source():
    data = DataConfig(train="a.jsonl", eval={"path": "e.parquet", "columns": {"prompt": "question"}})
    assert data.train_sources == [SourceConfig(path="a.jsonl")] and data.eval_sets[0].columns == {"prompt": "question"}
    mixed = DataConfig(train=["a.jsonl", {"path": "b.parquet", "weight": 3, "reward": "b:score"}], reward="m:r")
    assert [s.weight for s in mixed.train_sources] == [1.0, 3.0]
    assert mixed.reward_specs == (["m:r", "b:score"], [])  # each source's reward, each eval set's
    held_out = DataConfig(train="a.jsonl", eval={"path": "e.jsonl", "reward": "e:own"}, eval_reward="e:r", reward="m:r")
    assert held_out.reward_specs == (["m:r"], ["e:own"])
    assert DataConfig(train="a.jsonl", eval="e.jsonl", eval_reward="e:r", reward="m:r").reward_specs == (
        ["m:r"],
        ["e:r"],
    )
    for bad, needle in [
        ({"train": []}, "empty list"),
        ({"train": [{"path": "b.parquet", "weight": 0}]}, "greater than 0"),
        ({"train": {"path": "b", "columns": {"prompt": "q"}, "template": "{q}"}}, "not columns.prompt and template"),
        ({"train": {"path": "b", "template": "no field"}}, "template must name record fields"),
        ({"eval": []}, "data.eval is an empty list"),
        ({"eval": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}, "two sets are named a"),
        ({"eval": [{"name": "a b", "path": "x"}]}, "letters, digits"),
        ({"eval": [{"name": "a", "path": "x", "k": -1}]}, "greater than or equal to 0"),
        ({"eval": [{"name": "a", "path": "x"}], "eval_bar": "b"}, "eval_bar names no eval set"),
        ({"eval": "e.jsonl", "eval_bar": "b"}, "data.eval has no named sets"),
    ]:
        with pytest.raises(ValueError, match=needle):
            DataConfig(**bad)


def test_named_eval_sets_each_with_its_size_reward_and_k_the_bar_first():
    data = DataConfig(
        train="a.jsonl",
        reward="m:r",
        eval_reward="e:r",
        eval_size=50,
        eval=[
            {"name": "arith", "path": "a.jsonl"},
            {"name": "gsm", "path": "g.parquet", "columns": {"prompt": "question"}, "reward": "g:r", "size": 8, "k": 4},
        ],
        eval_bar="gsm",
    )
    sets = data.eval_sets
    assert [(s.name, s.size, s.k) for s in sets] == [("gsm", 8, 4), ("arith", 50, 0)]  # the bar's first
    assert data.reward_specs == (["m:r"], ["g:r", "e:r"]) and data.eval_prompts == 8 * 5 + 50
    one = DataConfig(train="a.jsonl", eval={"path": "reasoning_gym:chain_sum", "size": 20}, eval_size=64)
    assert [(s.name, s.size, s.k) for s in one.eval_sets] == [("", 20, 0)]  # one source: unnamed, its draws


def jsonl_source(tmp_path, name: str, n: int, weight: float = 1.0) -> PromptSet:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{name}{i}"}) + "\n" for i in range(n)))
    return PromptSet(SourceConfig(path=str(path), weight=weight))


def test_one_source_keeps_the_order_of_one_file(tmp_path):
    mix = Mixture([jsonl_source(tmp_path, "a", 37)], seed=5)
    assert [mix.pick(seq)[1:] for seq in range(100)] == [prompt_for_sequence(seq, 37, 5) for seq in range(100)]


def test_a_three_to_one_mixture_draws_its_shares_and_each_source_in_epochs(tmp_path):
    mix = Mixture([jsonl_source(tmp_path, "a", 300, 3.0), jsonl_source(tmp_path, "b", 50, 1.0)], seed=1)
    picks = [mix.pick(seq) for seq in range(10 * BLOCK)]
    shares = collections.Counter(source for source, _, _ in picks)
    assert shares[0] / len(picks) == pytest.approx(0.75, abs=0.02)
    for source, size in ((0, 300), (1, 50)):  # each source: every prompt once per epoch, epochs in turn
        drawn = [(epoch, index) for s, epoch, index in picks if s == source]
        for epoch in range(len(drawn) // size):
            assert sorted(i for e, i in drawn[epoch * size : (epoch + 1) * size] if e == epoch) == list(range(size))
    # any run of groups holds the shares to within a group or so, not only whole blocks
    for start, length in ((0, 40), (100, 100), (1000, 333), (5000, 7)):
        run = [s for s, _, _ in picks[start : start + length]]
        assert abs(run.count(0) - 0.75 * length) <= 1.5, (start, length, run.count(0))


def test_the_order_is_a_function_of_the_sequence_number_alone(tmp_path):
    """What a resume relies on: a fresh Mixture (a restarted generator) picks what the first one did for
    every group from the buffer's cursor on."""
    sets = [jsonl_source(tmp_path, "a", 30, 3.0), jsonl_source(tmp_path, "b", 20, 1.0)]
    first = [Mixture(sets, seed=7).record(seq)[3]["prompt"] for seq in range(3000)]
    resumed = Mixture(sets, seed=7)
    assert [resumed.record(seq)[3]["prompt"] for seq in range(1234, 3000)] == first[1234:]


def test_a_weight_below_one_group_a_block_is_refused(tmp_path):
    with pytest.raises(UserError, match="b.jsonl: its weight is below one group in 1024"):
        Mixture([jsonl_source(tmp_path, "a", 5, 5000.0), jsonl_source(tmp_path, "b", 5, 1.0)], seed=0)


@given(st.lists(st.floats(0.01, 100.0), min_size=1, max_size=8), st.integers(1, 5000))
def test_apportion_splits_the_total_within_one_of_each_share(weights, total):
    counts = apportion(weights, total)
    assert counts.sum() == total
    shares = [w / sum(weights) * total for w in weights]
    assert all(abs(c - s) < 1 for c, s in zip(counts, shares, strict=True))


@given(st.lists(st.floats(0.05, 20.0), min_size=2, max_size=6))
def test_every_prefix_of_a_block_holds_the_shares(weights):
    counts = apportion(weights, BLOCK)
    if (counts == 0).any():
        return  # refused by Mixture
    order, rank = _block_order(tuple(int(c) for c in counts))
    assert [int((order == s).sum()) for s in range(len(counts))] == counts.tolist()
    seen = np.zeros(len(counts))
    for n, source in enumerate(order, 1):
        assert rank[n - 1] == seen[source]
        seen[source] += 1
        assert np.abs(seen - counts * n / BLOCK).max() < 2.0, (n, seen, counts)  # SWRR: within a group or two


CHAIN_SUM = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}


def test_a_reasoning_gym_task_is_a_source_scored_by_its_own_verifier():
    from asyncrl.data.procedural import score

    train = PromptSet(SourceConfig(path="reasoning_gym:chain_sum", size=200, seed=1, options=CHAIN_SUM))
    held_out = PromptSet(SourceConfig(path="reasoning_gym:chain_sum", size=20, seed=2, options=CHAIN_SUM))
    record = train[5]
    assert len(train) == 200 and record["prompt"] == record["question"] and record["question"].endswith("=")
    assert train[5] == record  # made from its index: the same record each time it is read
    assert {r["question"] for r in held_out.head(20)} != {r["question"] for r in train.head(20)}
    assert score(record["prompt"], f" {record['answer']}\nand more", record) == 1.0
    assert score(record["prompt"], f"{int(record['answer']) + 1}", record) == 0.0
    assert score(record["prompt"], f"{record['metadata']['expression']} = {record['answer']}", record) == 1.0
    template = "What is {metadata[expression]}?"  # a template may reach into the task's metadata
    asked = PromptSet(SourceConfig(path="reasoning_gym:chain_sum", size=5, options=CHAIN_SUM, template=template))
    assert asked[0]["prompt"] == f"What is {asked[0]['metadata']['expression']}?"


@pytest.mark.parametrize(
    ("path", "options", "message"),
    [
        ("reasoning_gym:nonesuch", {}, "reasoning_gym:nonesuch: reasoning-gym cannot make it: ValueError"),
        ("reasoning_gym:chain_sum", {"terms": 3}, "unexpected keyword argument 'terms'"),
    ],
)
def test_a_task_reasoning_gym_cannot_make_is_one_error(path, options, message):
    with pytest.raises(UserError, match=message):
        PromptSet(SourceConfig(path=path, options=options))
