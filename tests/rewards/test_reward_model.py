"""A reward model ``asyncrl rm`` exported, as a run's reward (``data.reward: rm:<dir>``,
asyncrl.rewards.model): it scores what the trained model scores, concurrent calls share one forward,
its throughput is counted, and a directory that is no such export is one clear error."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import save_file

from asyncrl.errors import UserError
from asyncrl.models.reward_head import RewardModel, pad_pairs
from asyncrl.rewards.model import MAX_BATCH, REWARD_HEAD, SETTINGS, RewardModelReward
from asyncrl.rewards.resolve import load_reward


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A small reward model saved as ``learners.offline`` exports one (base model, head, chat settings)."""
    from asyncrl.demo.model import build_model, build_tokenizer

    tok = build_tokenizer()
    base = build_model(tok, seed=3).model
    rm = RewardModel(base, base.config.hidden_size)
    torch.nn.init.normal_(rm.head.weight, std=0.5)
    torch.nn.init.constant_(rm.head.bias, 5.0)  # scores far from the task reward's [0, 1]
    out = tmp_path_factory.mktemp("rm-export")
    base.save_pretrained(out)
    tok.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in rm.head.state_dict().items()}, out / REWARD_HEAD)
    (out / SETTINGS).write_text(json.dumps({"chat_template": True, "system_prompt": None}))
    return out, rm.eval(), tok


def test_scores_are_the_models_and_concurrent_calls_share_forwards(export):
    path, rm, tok = export
    reward = load_reward(f"rm:{path}", timeout_s=30.0)
    assert isinstance(reward, RewardModelReward)
    records = [{"prompt": f"sort:{w}=", "answer": "".join(sorted(w))} for w in ("dcba", "fed", "hgfe", "kji")] * 20
    completions = ["abcd", "def", "efgh", "ijk"] * 20

    async def all_at_once():
        return await asyncio.gather(*(reward(r["prompt"], c, r) for r, c in zip(records, completions, strict=True)))

    scores = asyncio.run(all_at_once())
    pairs = zip(records, completions, strict=True)
    seqs = [(tok.encode(r["prompt"]), tok.encode(c) + [tok.eos_token_id]) for r, c in pairs]
    batch = pad_pairs(seqs, tok.pad_token_id)
    with torch.no_grad():
        want = rm(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    assert torch.allclose(torch.tensor(scores), want.float(), atol=1e-5)
    assert len(set(round(s, 4) for s in scores)) == 4  # four different sequences, four different scores
    metrics = reward.metrics()
    assert metrics["reward_model/scored"] == len(records) and metrics["reward_model/samples_per_s"] > 0
    assert reward.forwards <= -(-len(records) // MAX_BATCH) + 1  # batched: not one forward per call


def test_a_directory_that_is_no_reward_model_export_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="not an asyncrl rm export"):
        load_reward(f"rm:{tmp_path}", timeout_s=1.0)


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.vllm
def test_a_run_trains_against_a_reward_model_and_evaluates_with_the_task_reward(export, tmp_path):
    import subprocess

    from demo_launch import ROOT, demo_launch_cmd

    path, _, _ = export
    sets = {
        "run.steps": 2,
        "run.eval_every": 0,
        "data.reward": f"rm:{path}",
        "data.eval_reward": "asyncrl.demo.sort:reward",
    }
    args = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    cmd = demo_launch_cmd(tmp_path, "rm-reward", "--generators", "1", "--learners", "1", *args)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "rm-reward/metrics.jsonl").read_text().splitlines()]
    scored = [m["reward_model/scored"] for m in metrics if "reward_model/scored" in m]
    assert scored and max(scored) > 0  # the generator scored its groups with the reward model
    train_rewards = [m["generator/reward_mean"] for m in metrics if "generator/reward_mean" in m]
    assert train_rewards and all(r > 1 for r in train_rewards)  # the model's scores, not the task's [0, 1]
    evals = [m["eval/reward_mean"] for m in metrics if "eval/reward_mean" in m]
    assert evals and all(0.0 <= r <= 1.0 for r in evals)  # the held-out evaluation kept the task's reward
