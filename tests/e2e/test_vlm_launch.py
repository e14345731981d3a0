"""The vision-language demo through `asyncrl launch` as a user runs it (the README's command: configs/demo-shapes.yaml,
a tiny Idefics3 on the real vLLM engine with images, two generators, two DeepSpeed learner ranks, lag 1, 40 steps):
it reaches the README's bar, the engine's behaviour log-probs are the learner's with the same pixels, every
version applied matches the learner's, each version carries the language model alone (the tower frozen), and the
HF export loads in transformers (model and processor) and in vLLM with the warm-up's vision tower untouched. With
``model.freeze_vision: false`` the tower trains too and every version carries it (on-policy, lag 0: every step
compares every token): the engines' behaviour log-probs still match the learner's, which they could not if a
generator kept an older tower."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from demo_launch import ROOT, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]

STEPS = 40  # configs/demo-shapes.yaml's
# README.md's demo table, "0.00 -> 0.75-1.00 in 40 steps" (held-out greedy reward): the async order of a run (its
# machine's load) decides how many colours 40 steps teach; 4 clean-clone runs reached 1.00, 0.99, 0.99 and 0.75
README_BAR = (0.0, 0.75)
BAR_SLACK = 2 / 128  # 2 of the 128 held-out prompts


def launch(out, name: str, *args: str):
    cmd = [sys.executable, "-m", "asyncrl.cli", "launch", "--config", "configs/demo-shapes.yaml", "--name", name,
           "--set", f"run.out_dir={out}", *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / name


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("vlm"), "vlm")  # the README's command, as the config says


def test_the_readme_command_reaches_the_readmes_bar(run_dir):
    import json

    readme = (ROOT / "README.md").read_text()
    assert "| 0.00 -> 0.75-1.00 in 40 steps" in readme.split("configs/demo-shapes.yaml")[1].splitlines()[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_version"] == STEPS
    assert summary["initial_eval_reward"] == README_BAR[0], summary["evals"]
    assert summary["final_eval_reward"] >= README_BAR[1] - BAR_SLACK, summary["evals"]


def warmed_up() -> dict:
    from transformers import AutoModelForImageTextToText

    path = ROOT / ".cache" / "models" / "demo-shapes"
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).state_dict()


def test_the_vlm_demo_learns_with_the_engines_logprobs_the_learners(run_dir):
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in records if "learner/version" in r]
    assert len(steps) == STEPS
    # lag 1: a step compares the tokens sampled by the version the learner holds, where its batch has any
    compared = [r for r in steps if r["learner/behaviour_logprob_mismatch_tokens"] > 0]
    assert compared and max(r["learner/behaviour_logprob_mismatch"] for r in compared) < 0.01
    evals = [r["eval/reward_mean"] for r in records if "eval/reward_mean" in r]
    assert evals[0] <= 0.4 and evals[-1] > evals[0] + 0.2, evals
    applied = [r for r in records if "weights/applied_at" in r]
    assert STEPS in {r["generator/version"] for r in applied}  # at lag 1 a generator may skip one: newest wins
    # a probe still unscored when the next version loads is dropped, not mixed (generators/scheduler.py)
    probed = [r["weights/probe_logprob_diff"] for r in applied if "weights/probe_logprob_diff" in r]
    assert len(probed) >= STEPS // 2 and max(probed) < 1e-4


def test_the_export_loads_in_transformers_and_vllm_with_the_frozen_tower_as_warmed_up(run_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vllm_common import PlainParamsExtension  # one extension class per process (tests/vllm_common.py)

    from asyncrl.config import load_config
    from asyncrl.generators.vllm_engine import VllmEngine
    from asyncrl.learners.train_step import probe_logprobs
    from asyncrl.models.vision import language_names

    export = run_dir / "export"
    model, info = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weight
    assert AutoProcessor.from_pretrained(export).image_token == "<image>"
    start = warmed_up()
    language = language_names(model)
    trained = {k for k, v in model.state_dict().items() if not torch.equal(v, start[k])}
    assert trained and trained <= language  # the tower and connector exactly as the warm-up left them
    cfg = load_config(None, {"model.path": str(export), "model.recipe": None})
    engine = VllmEngine(cfg.generator.engine, cfg.model, 4, seed=0, extension=PlainParamsExtension)
    ids = list(range(40, 70))
    assert engine.score(ids) == pytest.approx(probe_logprobs(model.eval(), ids), abs=1e-4)


def test_a_trained_tower_travels_with_every_version(tmp_path):
    from transformers import AutoModelForImageTextToText

    from asyncrl.models.vision import language_names

    run = launch(tmp_path, "tower", "--generators", "1", "--learners", "1", "--steps", "3", "--max-policy-lag", "0",
                 "--set", "generator.eval=false", "--set", "model.freeze_vision=false")  # fmt: skip
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "learner/version" in r]
    assert len(steps) == 3 and all(r["learner/behaviour_logprob_mismatch_tokens"] > 0 for r in steps)
    assert max(r["learner/behaviour_logprob_mismatch"] for r in steps) < 0.01
    model = AutoModelForImageTextToText.from_pretrained(run / "export", dtype=torch.float32)
    start, language = warmed_up(), language_names(model)
    trained = {k for k, v in model.state_dict().items() if not torch.equal(v, start[k])}
    assert trained - language  # the tower moved
