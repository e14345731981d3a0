"""A missing ``model.path`` is named, and a recipe is mentioned only when the config named one: a config
that never set ``model.recipe`` once got "model.recipe=demo-sort builds only at ..." (the field's default)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from demo_launch import ROOT, assert_one_line_error

from asyncrl.config import load_config
from asyncrl.errors import UserError
from asyncrl.run.preflight import check_model_path, check_named, ensure_model

DATA = """
data:
  train: data/sort/train.jsonl
  eval: data/sort/eval.jsonl
  reward: asyncrl.demo.sort:reward
"""


def error_of(text: str) -> str:
    cfg = load_config(None, text=text)
    with pytest.raises(UserError) as err:
        check_model_path(cfg.model)
    with pytest.raises(UserError) as again:
        ensure_model(cfg, log=lambda _: None)
    assert str(again.value) == str(err.value)
    return str(err.value)


def test_a_config_that_names_no_recipe_hears_only_of_its_path(tmp_path):
    missing = tmp_path / "no-such-model"
    message = error_of(f"model:\n  path: {missing}\n")
    assert message == f"model.path {missing} does not exist"
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    message = error_of(f"model:\n  path: {not_a_model}\n")
    assert message == f"model.path {not_a_model} is not an HF model directory (no config.json)"


def test_a_config_that_names_a_recipe_hears_where_it_builds(tmp_path):
    missing = tmp_path / "calc"
    message = error_of(f"model:\n  path: {missing}\n  recipe: demo-calc\n")
    assert message.startswith(f"model.path {missing} does not exist")
    assert "model.recipe=demo-calc builds only at .cache/models/demo-calc" in message


def test_a_recipe_alone_builds_at_its_own_cache_path():
    model = load_config(None, text="model:\n  recipe: demo-sort\n").model
    assert model.path == ".cache/models/demo-sort" and model.builds_recipe
    check_model_path(model)  # no error: demo-sort builds there


def test_the_core_has_no_default_task():
    """The demo is a recipe a config names, not the core's default: a run that names no model, prompts or
    reward is told which (issue 24)."""
    cfg = load_config(None, text="run:\n  name: x\n")
    assert (cfg.model.path, cfg.model.recipe, cfg.data.train, cfg.data.eval, cfg.data.reward) == (None,) * 5
    with pytest.raises(UserError, match="the config sets no model.path"):
        check_model_path(cfg.model)
    with pytest.raises(UserError) as err:
        check_named(cfg)
    assert str(err.value) == (
        "the config sets no model.path, data.train, data.reward: a run names its model (or model.recipe), "
        "its prompts and its reward; configs/demo-cpu.yaml names the sort demo's"
    )
    check_named(load_config(ROOT / "configs" / "demo-cpu.yaml"))  # the demo's config names all three


@pytest.mark.slow  # the dry run imports the demo's reward and episode code (seconds)
def test_launch_names_the_missing_path_in_one_line(tmp_path):
    config = tmp_path / "mine.yaml"
    missing = tmp_path / "my-model"
    config.write_text(f"model:\n  path: {missing}\n" + DATA)
    cmd = [sys.executable, "-m", "asyncrl.cli", "launch", "--config", str(config), "--dry-run"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert_one_line_error(out, f"model.path {missing} does not exist")
    assert "recipe" not in out.stderr and "demo-sort" not in out.stderr


def test_an_expert_width_vllms_cpu_kernel_cannot_update_is_one_line(tmp_path):
    """vLLM 0.32's CPU MoE kernel pads expert widths to a multiple of 32 and then refuses every reload
    (docs/models.md); preflight says so before anything starts, and the transformers engine is let through."""
    import json

    from asyncrl.run.preflight import check_experts

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "moe_intermediate_size": 48}))
    cfg = load_config(None, {"model.path": str(tmp_path), "model.recipe": None})
    with pytest.raises(UserError, match=r"moe_intermediate_size 48 is not a multiple of 32.*engine.type=hf"):
        check_experts(cfg)
    check_experts(load_config(None, {"model.path": str(tmp_path), "model.recipe": None, "generator.engine.type": "hf"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "moe_intermediate_size": 64}))
    check_experts(cfg)
