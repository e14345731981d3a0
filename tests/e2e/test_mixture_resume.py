"""A 3:1 mixture of a JSONL file and a Parquet source (issue 49), run once uninterrupted and once killed with
``kill -9`` of every process then ``--resume``d: both draw the prompts of the same order, group by group (the
order is a function of the buffer's cursor, which the resume keeps), no group is skipped (a group's claim is
journaled by its admission, atomically), and the sampled share is 75%. The prompts are read back from what the
reward scored."""

from __future__ import annotations

import json
import os
import signal

import pytest
from demo_launch import ROOT, demo_launch_cmd
from test_resume import committed_version, resume_cmd, run_pids, start, wait_gone
from test_supervision import wait_for

from asyncrl.config import load_config
from asyncrl.data.sources import open_train

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]
STEPS = 16
IN_FLIGHT = 64 // 8  # groups a generator may have claimed and not yet scored (episodes_in_flight / n_samples)

REWARD = """
import os

from asyncrl.demo.sort import reward as sort_reward


def reward(prompt, completion, record):
    if "src" in record:  # a training prompt (the held-out set has none): logged as the reward sees it
        with open(os.environ["PROMPT_LOG"], "a") as log:
            log.write(prompt + "\\n")
    return sort_reward(prompt, completion, record)
"""


def mixture(tmp_path) -> dict[str, str]:
    """The demo's train split cut in two: a JSONL file (weight 3) and a Parquet file with its own columns
    (weight 1); the --set flags of a run on them with the logging reward."""
    import datasets

    records = [json.loads(line) for line in (ROOT / "data" / "sort" / "train.jsonl").read_text().splitlines()]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({**r, "src": "a"}) + "\n" for r in records[:2000]))
    rest = records[2000:]
    columns = {"letters": [r["prompt"][5:-1] for r in rest], "sorted": [r["answer"] for r in rest], "src": ["b"] * 2000}
    datasets.Dataset.from_dict(columns).to_parquet(str(tmp_path / "b.parquet"))
    (tmp_path / "logging_reward.py").write_text(REWARD)
    b = f"{{path: {tmp_path}/b.parquet, template: 'sort:{{letters}}=', columns: {{answer: sorted}}, weight: 1}}"
    return {"data.train": f"[{{path: {tmp_path}/a.jsonl, weight: 3}}, {b}]", "data.reward": "logging_reward:reward",
            "run.steps": str(STEPS), "run.generators": "1", "run.learners": "1", "run.eval_every": "0"}  # fmt: skip


def scored_sequence_numbers(log_path, order: dict[str, int]) -> set[int]:
    prompts = set(log_path.read_text().splitlines())
    assert prompts <= set(order), f"prompts outside the mixture's order: {sorted(prompts - set(order))[:3]}"
    return {order[p] for p in prompts}


def test_a_mixture_keeps_its_order_and_shares_across_a_kill_9_and_resume(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    sets = mixture(tmp_path)
    args = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")  # the reward

    logs = {}
    for name in ("whole", "resumed"):
        logs[name] = tmp_path / f"{name}.log"
        monkeypatch.setenv("PROMPT_LOG", str(logs[name]))
        proc = start(demo_launch_cmd(tmp_path, name, *args))
        run_dir = tmp_path / name
        try:
            if name == "resumed":  # kill -9 of everything once a checkpoint is committed, then --resume
                wait_for(lambda run_dir=run_dir: committed_version(run_dir) >= 1, 400, "a checkpoint", proc, run_dir)
                pids = run_pids(run_dir)
                for pid in pids.values():
                    os.kill(pid, signal.SIGKILL)
                proc.wait(timeout=60)
                wait_gone(pids, 30)
                before = len(logs[name].read_text().splitlines())
                proc = start(resume_cmd(run_dir))
            out, _ = proc.communicate(timeout=900)
            assert proc.returncode == 0, out[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert before > 0 and len(logs["resumed"].read_text().splitlines()) > before  # scored on both sides of the kill

    cfg = load_config(tmp_path / "whole" / "config.yaml")
    train = open_train(cfg)
    order = {}
    for seq in range(4000):
        order.setdefault(train.record(seq)[3]["prompt"], seq)  # each prompt's first draw (no epoch ends by then)
    drawn = {name: scored_sequence_numbers(log, order) for name, log in logs.items()}
    for name, seqs in drawn.items():
        gaps = set(range(max(seqs) + 1)) - seqs  # claimed and never scored
        tail = {seq for seq in gaps if seq > max(seqs) - 4 * IN_FLIGHT}  # in flight when the run ended
        assert len(tail) <= IN_FLIGHT, (name, gaps)
        assert not gaps - tail, (name, gaps)  # the kill: every group admitted before it was played again
        share = sum(1 for seq in seqs if train.pick(seq)[0] == 0) / len(seqs)
        assert share == pytest.approx(0.75, abs=0.02), (name, share)
    common = min(max(seqs) for seqs in drawn.values()) - 4 * IN_FLIGHT
    assert all(set(range(common)) <= seqs for seqs in drawn.values())  # the same prompts, group by group
