"""The demo trained from data kept as users keep it (issue 49): its prompts as Parquet with their own column
names and a template, its held-out set as a `save_to_disk` directory with a column mapping, no conversion
step; each source's own reward sees the mapped fields, and the policy learns."""

from __future__ import annotations

import json
import os
import subprocess

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
        f"{{path: {tmp_path}/eval, columns: {{prompt: q, answer: a}}, reward: 'checked_reward:reward'}}",
    )


def test_the_demo_learns_from_parquet_and_a_saved_dataset_with_its_columns_mapped(tmp_path):
    pytest.importorskip("vllm")
    train, held_out = users_data(tmp_path)
    (tmp_path / "checked_reward.py").write_text(REWARD)
    sets = {"data.train": train, "data.eval": held_out, "data.reward": "checked_reward:never", "run.steps": 12,
            "run.eval_every": 6, "run.generators": 1, "run.learners": 1, "data.eval_size": 64}  # fmt: skip
    args = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        demo_launch_cmd(tmp_path, "sources", *args), cwd=ROOT, capture_output=True, text=True, timeout=900, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "sources" / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["final_version"] == 12
    assert not summary.get("episodes_failed"), summary  # the sources' rewards, and their checks held for every record
    assert summary["final_eval_reward"] > summary["initial_eval_reward"] + 0.1, summary
