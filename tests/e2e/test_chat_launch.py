"""A real chat model through `asyncrl launch`: SmolLM2-135M-Instruct (the recipe), with chat `messages` and
plain prompts in one dataset (one launch); the generator's prompt tokens are the tokenizer's own
`apply_chat_template`, the reward receives the rendered prompt, stop strings end turns, and the weight-sync
probe holds at the default lag (1)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from demo_launch import ROOT, demo_launch_cmd

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]

TESTS = Path(__file__).resolve().parents[1]
SYSTEM = "You are terse."
QUESTIONS = ["What is 2 + 3?", "Name a colour.", "What is the capital of France?", "Say hello."]


def records(reward_log: Path) -> list[dict]:
    """Both kinds of task line, chats first: four chat ``messages`` and four plain ``prompt`` strings."""
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    return [{"messages": chat, "reward_log": str(reward_log)} for chat in chats] + [
        {"prompt": q, "reward_log": str(reward_log)} for q in QUESTIONS
    ]


def expected_messages(record: dict) -> list[dict]:
    """What the chat template must render: the record's messages, or a plain prompt as the user's
    message after the configured system prompt."""
    if "messages" in record:
        return record["messages"]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": record["prompt"]}]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_chat_template_is_applied_through_launch(tmp_path):
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    episodes, rewards, data = tmp_path / "episodes.jsonl", tmp_path / "rewards.jsonl", tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records(rewards)))
    overrides = {
        "model.path": ".cache/models/smollm2-135m-instruct",
        "model.recipe": "smollm2-135m-instruct",
        "data.train": str(data),
        "data.eval": "null",
        "data.reward": "chat_fixtures:recording_reward",
        "episode.function": "chat_fixtures:recording_episode",
        "episode.options": json.dumps({"log": str(episodes)}),
        "episode.system_prompt": json.dumps(SYSTEM),
        "generator.stop": json.dumps(["."]),
        "generator.max_new_tokens": 12,
        "generator.n_samples": 2,
        "generator.episodes_in_flight": 4,
        "generator.max_model_len": 256,
        "generator.eval": "false",
        "learner.groups_per_step": 4,  # 2 steps of 4: 8 groups, one epoch (every line once)
        "learner.zero_stage": 0,
        "learner.checkpoint": "false",
        "run.steps": 2,
        "run.eval_every": 0,
    }
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    cmd = demo_launch_cmd(tmp_path, "chat", "--generators", "1", "--learners", "1", *sets)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "chat" / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["final_version"] == 2

    tok = AutoTokenizer.from_pretrained(ROOT / ".cache/models/smollm2-135m-instruct")
    seen = read(episodes)
    assert {"messages" in e["task"] for e in seen} == {True, False}, seen  # both kinds went through
    for entry in seen:
        messages = expected_messages(entry["task"])
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert entry["prompt_ids"] == list(ids)
        assert tok.decode(entry["prompt_ids"]).endswith("<|im_start|>assistant\n")
    scored = read(rewards)
    assert {r["chat"] for r in scored} == {True, False}
    # a chat's reward reads the conversation as the template rendered it; a plain prompt's, the prompt as written
    rendered = {tok.apply_chat_template(expected_messages(r), add_generation_prompt=True, tokenize=False)
                for r in records(rewards) if "messages" in r}  # fmt: skip
    assert {r["prompt"] for r in scored if r["chat"]} <= rendered
    assert {r["prompt"] for r in scored if not r["chat"]} <= set(QUESTIONS)
    completions = [r["completion"] for r in scored]
    assert all("." not in c[:-1] for c in completions)  # a stop string ends the turn's text
    metrics = read(tmp_path / "chat" / "metrics.jsonl")
    probes = [m["weights/probe_logprob_diff"] for m in metrics if "weights/probe_logprob_diff" in m]
    assert probes and max(probes) < 1e-3, probes  # vLLM serves exactly the learner's weights
    assert all("learner/behaviour_logprob_mismatch_tokens" in m for m in metrics if "learner/version" in m)
