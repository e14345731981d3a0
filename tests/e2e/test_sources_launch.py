"""The demo trained from data kept as users keep it (issue 49): its prompts as Parquet with their own column
names and a template, its held-out sets from a `save_to_disk` directory with a column mapping, no conversion
step; each source's own reward sees the mapped fields, and the policy learns. Two named eval sets with rewards
of their own, one also sampled 4 times a prompt (pass@4), are reported per set in every sink: the console,
metrics.jsonl, TensorBoard, summary.json, `asyncrl status` and `asyncrl plot`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from demo_launch import ROOT, demo_launch_cmd

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]

REWARD = '''
from asyncrl.demo.sort import reward as sort_reward

SEEN = {"train": {"letters", "sorted", "answer", "prompt"}, "eval": {"q", "a", "prompt", "answer"}}


def reward(prompt, completion, record):
    """The sort demo's reward, for a record that carries the source's columns and the mapped fields only."""
    assert set(record) in SEEN.values(), sorted(record)
    assert prompt.startswith("sort:") and prompt.endswith("="), prompt
    return sort_reward(prompt, completion, record)


def exact(prompt, completion, record):
    """Another eval set's own reward: all or nothing."""
    return float(reward(prompt, completion, record) >= 1.0)


def never(prompt, completion, record):
    raise AssertionError("data.reward was called: each source names its own")
'''


def users_data(tmp_path) -> tuple[str, str]:
    """The demo's train split as Parquet (``letters``, ``sorted``) and its eval split saved by ``datasets``
    (``q``, ``a``): the train source's YAML and the eval source's."""
    import datasets

    def split(name: str) -> list[dict]:
        return [json.loads(line) for line in (ROOT / "data" / "sort" / f"{name}.jsonl").read_text().splitlines()]

    train = {"letters": [r["prompt"][5:-1] for r in split("train")], "sorted": [r["answer"] for r in split("train")]}
    datasets.Dataset.from_dict(train).to_parquet(str(tmp_path / "train.parquet"))
    held_out = {"q": [r["prompt"] for r in split("eval")], "a": [r["answer"] for r in split("eval")]}
    datasets.Dataset.from_dict(held_out).save_to_disk(str(tmp_path / "eval"))
    return (
        f"{{path: {tmp_path}/train.parquet, template: 'sort:{{letters}}=', columns: {{answer: sorted}}, "
        "reward: 'checked_reward:reward'}",
        f"[{{name: sort, path: {tmp_path}/eval, columns: {{prompt: q, answer: a}}, reward: 'checked_reward:reward', "
        "k: 4, size: 32}, "
        f"{{name: exact, path: {tmp_path}/eval, columns: {{prompt: q, answer: a}}, reward: 'checked_reward:exact'}}]",
    )


def test_the_demo_learns_from_parquet_and_a_saved_dataset_with_its_columns_mapped_two_eval_sets_in_every_sink(
    tmp_path,
):
    pytest.importorskip("vllm")
    train, held_out = users_data(tmp_path)
    (tmp_path / "checked_reward.py").write_text(REWARD)
    sets = {"data.train": train, "data.eval": held_out, "data.reward": "checked_reward:never", "run.steps": 12,
            "run.eval_every": 6, "run.generators": 1, "run.learners": 1, "data.eval_size": 64}  # fmt: skip
    args = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "COLUMNS": "400"}
    proc = subprocess.run(
        demo_launch_cmd(tmp_path, "sources", *args), cwd=ROOT, capture_output=True, text=True, timeout=900, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "sources" / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["final_version"] == 12
    assert not summary.get("episodes_failed"), summary  # the sources' rewards, and their checks held for every record
    assert summary["final_eval_reward"] > summary["initial_eval_reward"] + 0.1, summary
    run_dir = tmp_path / "sources"
    # per set, in every sink; the bar is the first set's greedy reward
    sets, figures = summary["eval_sets"], ("reward_mean", "exact_rate", "mean@4", "pass@4")
    assert summary["eval_bar"] == "sort" and sorted(sets) == ["exact", "sort"]
    assert sorted(sets["sort"]) == ["0", "12", "6"] and sorted(sets["sort"]["12"]) == sorted(figures)
    assert sorted(sets["exact"]["12"]) == ["exact_rate", "reward_mean"]  # greedy only
    assert summary["final_eval_reward"] == sets["sort"]["12"]["reward_mean"]
    assert sets["sort"]["12"]["pass@4"] >= sets["sort"]["12"]["mean@4"] > 0  # a right sample among 4: learned
    assert all(0 <= v["reward_mean"] <= 1 and v["reward_mean"] == v["exact_rate"] for v in sets["exact"].values())
    evals = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval/version" in r]
    assert len(evals) == 3 and all(r["eval/reward_mean"] == r["eval/sort/reward_mean"] for r in evals)
    assert all(f"eval/sort/{f}" in r and "eval/exact/reward_mean" in r for r in evals for f in figures)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {f"eval/sort/{f}" for f in figures} | {"eval/exact/reward_mean", "eval/reward_mean"} <= tags
    assert [e.step for e in board.Scalars("eval/sort/pass@4")] == [0, 6, 12]
    said = proc.stdout + proc.stderr
    assert "sort: reward_mean" in said and "pass@4" in said and "exact: reward_mean" in said, said[-3000:]
    cli = [sys.executable, "-m", "asyncrl.cli", "status", "--run", str(run_dir)]
    status = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr[-2000:]
    assert "eval at version 12" in status.stdout and "sort (the bar):" in status.stdout, status.stdout
    assert "pass@4" in status.stdout and "exact:" in status.stdout, status.stdout
    from asyncrl.observe.plot import dashboard, load_run, set_curves

    assert set_curves([load_run(run_dir)]) == ["eval/exact/reward_mean", "eval/sort/pass@4", "eval/sort/reward_mean"]
    assert dashboard([run_dir]).stat().st_size > 10_000
