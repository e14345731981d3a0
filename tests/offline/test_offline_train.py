"""``asyncrl sft | rm | dpo`` end to end on the demo model (real DeepSpeed ranks, the demo's sort data),
and their bad-input rules: every problem is one clear error before any rank starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from demo_launch import ROOT

from asyncrl.errors import UserError
from asyncrl.observe.metrics import read_metrics
from asyncrl.offline.data import load_examples


def run_mode(mode: str, config: str, tmp_path: Path, *sets: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "asyncrl.cli", mode, "--config", str(ROOT / config)]
    cmd += ["--set", f"run.out_dir={tmp_path}", "--set", "model.path=" + str(ROOT / ".cache/models/demo-sort")]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def evals(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/version" in r]


@pytest.mark.slow
def test_sft_lowers_held_out_loss_lifts_greedy_reward_and_exports(tmp_path):
    out = run_mode("sft", "configs/sort-sft.yaml", tmp_path, "run.steps=6", "run.eval_every=3", "data.eval_size=64")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[sft] step 6/6" in out.stdout
    first, *_, last = evals(tmp_path / "sort-sft")
    assert [first["eval/version"], last["eval/version"]] == [0, 6]
    assert last["eval/loss"] < first["eval/loss"] and last["eval/reward"] > first["eval/reward"] + 0.2
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "sort-sft/export")  # an HF model
    assert (tmp_path / "sort-sft/tensorboard").is_dir()


@pytest.mark.slow
def test_dpo_on_two_ranks_raises_the_greedy_reward(tmp_path):
    out = run_mode("dpo", "configs/sort-dpo.yaml", tmp_path, "run.steps=6", "run.eval_every=6", "run.learners=2")
    assert out.returncode == 0, out.stdout + out.stderr
    first, last = evals(tmp_path / "sort-dpo")
    assert first["eval/loss"] == pytest.approx(0.6931, abs=1e-3)  # the policy is its own reference
    assert last["eval/accuracy"] > 0.8 and last["eval/reward"] > first["eval/reward"] + 0.2
    assert "reference log-probs" in (tmp_path / "sort-dpo/rank-1.log").read_text()


@pytest.mark.slow
def test_a_reward_model_learns_the_pairs_and_exports_its_head(tmp_path):
    out = run_mode("rm", "configs/sort-rm.yaml", tmp_path, "run.steps=20", "run.eval_every=20", "data.eval_size=64")
    assert out.returncode == 0, out.stdout + out.stderr
    first, last = evals(tmp_path / "sort-rm")
    assert first["eval/accuracy"] == 0.0 and last["eval/accuracy"] > 0.6  # the zero head ties every pair at first
    from safetensors.torch import load_file

    head = load_file(tmp_path / "sort-rm/export/reward_head.safetensors")
    assert head["weight"].shape[0] == 1 and head["weight"].abs().sum() > 0
    assert (tmp_path / "sort-rm/export/config.json").is_file()


def test_bad_examples_are_errors_naming_the_file_and_line(tmp_path):
    from asyncrl.chat import ChatTokens
    from asyncrl.demo.model import build_tokenizer

    chat = ChatTokens(build_tokenizer())
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "sort:cba=", "chosen": "abc", "rejected": "acb"}) + "\n")
    (example,) = load_examples(good, "dpo", chat, 64)
    assert example.responses[0][-1] == chat.tok.eos_token_id  # the reply ends the turn
    cases = {
        "sft": ({"prompt": "x"}, "missing 'response'"),
        "dpo": ({"prompt": "x", "chosen": "a", "rejected": 3}, "'rejected' must be a string"),
        "rm": ({"prompt": "x", "chosen": "a"}, "missing 'rejected'"),
    }
    for mode, (record, message) in cases.items():
        bad = tmp_path / f"{mode}.jsonl"
        bad.write_text(json.dumps({"prompt": "x", "response": "y", "chosen": "a", "rejected": "b"}) + "\n")
        bad.write_text(bad.read_text() + json.dumps(record) + "\n")
        with pytest.raises(UserError, match=f"{mode}.jsonl:2: {message}"):
            load_examples(bad, mode, chat, 64)
    chat_sft = tmp_path / "chat.jsonl"
    chat_sft.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(UserError, match="chat.jsonl:1: 'messages' must end with the assistant's reply"):
        load_examples(chat_sft, "sft", chat, 64)
    with pytest.raises(UserError, match=r"good.jsonl:1: \d+ tokens .* more than data.max_len=4"):
        load_examples(good, "dpo", chat, 4)


def test_bad_configs_fail_before_any_rank_starts(tmp_path):
    cases = [
        ("sft", ["train.batch_size=3", "run.learners=2"], "must be divisible by run.learners"),
        ("sft", ["data.train=null"], "data.train is required"),
        ("dpo", ["train.dpo_loss=hinge"], "train.dpo_loss"),
        ("dpo", ["learner.zero_stage=3"], "needs learner.zero_stage < 3"),
        ("rm", ["data.train=nowhere.jsonl"], "dataset file not found: nowhere.jsonl"),
        ("sft", ["model.path=no/such/model", "model.recipe=null"], "no/such/model"),
    ]
    config = {"sft": "configs/sort-sft.yaml", "rm": "configs/sort-rm.yaml", "dpo": "configs/sort-dpo.yaml"}
    for mode, sets, message in cases:
        cmd = [sys.executable, "-m", "asyncrl.cli", mode, "--config", config[mode], "--dry-run"]
        cmd += [x for s in [f"run.out_dir={tmp_path}", *sets] for x in ("--set", s)]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and message in out.stderr, (mode, sets, out.stderr)
    assert not any(tmp_path.iterdir())  # nothing made


def test_dry_run_prints_the_resolved_config(tmp_path):
    cmd = [sys.executable, "-m", "asyncrl.cli", "dpo", "--config", "configs/sort-dpo.yaml", "--dry-run"]
    out = subprocess.run(cmd + ["--steps", "7"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert "steps: 7" in out.stdout and "dpo_loss: sigmoid" in out.stdout


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_with_its_name_and_no_rank_left_behind(tmp_path):
    import signal
    import time

    import psutil

    cmd = [sys.executable, "-m", "asyncrl.cli", "sft", "--config", str(ROOT / "configs/sort-sft.yaml")]
    for s in (f"run.out_dir={tmp_path}", "run.learners=2", "run.steps=100000", "run.eval_every=0", "data.eval=null"):
        cmd += ["--set", s]
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, ranks = time.monotonic() + 120, {}
        while time.monotonic() < deadline and len(ranks) < 2:
            for child in psutil.Process(launcher.pid).children():
                if "asyncrl.offline.train" in " ".join(child.cmdline()):
                    ranks[child.environ()["RANK"]] = child
            time.sleep(0.2)
        assert len(ranks) == 2, "the two ranks never started"
        metrics = tmp_path / "sort-sft/metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.is_file() and metrics.read_text()):
            time.sleep(0.2)  # training has begun
        ranks["1"].send_signal(signal.SIGKILL)
        out, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 1, out
    assert "learner-1 failed (exit code -9)" in out
    psutil.wait_procs(list(ranks.values()), timeout=30)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks.values())


@pytest.mark.slow
def test_dpo_steps_are_the_same_at_zero_0_and_zero_3_on_two_ranks(tmp_path):
    """ZeRO 3 gathers each layer in every forward, a collective: the reference pass and the evaluation
    run as many forwards on each rank, and the steps equal ZeRO 0's."""
    losses = {}
    for stage in (0, 3):
        sets = ("run.steps=3", "run.eval_every=0", "run.learners=2", "data.reward=null", "data.eval_size=10")
        out = run_mode("dpo", "configs/sort-dpo.yaml", tmp_path / f"z{stage}", *sets, f"learner.zero_stage={stage}")
        assert out.returncode == 0, out.stdout + out.stderr
        records = read_metrics(tmp_path / f"z{stage}/sort-dpo/metrics.jsonl")
        losses[stage] = [r.get("learner/loss", r.get("eval/loss")) for r in records]
    assert len(losses[0]) == 5 and losses[0] == pytest.approx(losses[3], abs=1e-6)


@pytest.mark.slow
def test_a_resumed_run_goes_on_from_its_checkpoint_as_if_never_stopped(tmp_path):
    """A constant learning rate (the schedule then does not depend on run.steps): 3 steps, then --resume
    to 6, against 6 steps in one go: the same examples in the same order, the optimizer's state restored,
    so the same losses."""
    sets = ("run.eval_every=0", "data.reward=null", "data.eval_size=16", "learner.lr_final_ratio=1.0")
    whole = run_mode("sft", "configs/sort-sft.yaml", tmp_path / "whole", "run.steps=6", *sets)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    first = run_mode("sft", "configs/sort-sft.yaml", tmp_path / "parts", "run.steps=3", *sets)
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = tmp_path / "parts/sort-sft"
    cmd = [sys.executable, "-m", "asyncrl.cli", "sft", "--resume", str(run_dir), "--steps", "6"]
    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed at step 3" in resumed.stdout

    def losses(path: Path) -> dict[int, float]:
        return {r["learner/version"]: r["learner/loss"] for r in read_metrics(path) if "learner/version" in r}

    want, got = losses(tmp_path / "whole/sort-sft/metrics.jsonl"), losses(run_dir / "metrics.jsonl")
    assert sorted(got) == [1, 2, 3, 4, 5, 6] and got == pytest.approx(want, abs=1e-6)
    wrong = subprocess.run([*cmd[:3], "dpo", *cmd[4:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "is not an asyncrl dpo run" in wrong.stderr
