"""Bad input a user can give ends in one error line and touches nothing (issue 11, defects 5, 8, 10, 11):
unsafe run names, secrets in what is stored or shown, reward modules that do not import, invalid YAML,
and a model path that is not a model."""

from __future__ import annotations

import os
import stat

import pytest
from demo_launch import DEMO, assert_one_line_error, asyncrl

from asyncrl.config import dump_config, load_config
from asyncrl.errors import UserError


@pytest.mark.parametrize("name", ["..", ".", "...", "a..b/..", "-rf"])
def test_a_run_name_must_make_a_new_child_of_out_dir(tmp_path, name):
    parent = tmp_path / "runs"
    parent.mkdir()
    (tmp_path / "config.yaml").write_text("keep me\n")
    proc = asyncrl("launch", "--config", str(DEMO), f"--name={name}", "--set", f"run.out_dir={parent}", "--dry-run")
    assert_one_line_error(proc, "run.name")
    assert (tmp_path / "config.yaml").read_text() == "keep me\n"


def test_ordinary_names_are_fine():
    for name in ("demo", "exp-1.2_b", "a.b"):
        assert load_config(DEMO, {"run.name": name}).run_dir.name == name


def test_secrets_are_redacted_where_the_config_is_shown_or_stored():
    cfg = load_config(DEMO, {"buffer.url": "redis://:hunter2@127.0.0.1:6379/0"})
    text = dump_config(cfg)
    assert "hunter2" not in text and "redis://:***@127.0.0.1:6379/0" in text
    assert cfg.buffer.url.endswith("hunter2@127.0.0.1:6379/0")  # the running config keeps it
    served = {"data.reward": "http://:tok1@127.0.0.1:9/score", "episode.env_url": "http://:tok2@10.0.0.2:8000"}
    cfg = load_config(DEMO, {**served, "episode.function": None})
    shown, stored = dump_config(cfg), dump_config(cfg, shown=False)
    assert "tok1" not in shown and "tok2" not in shown and "http://:***@10.0.0.2:8000" in shown  # --dry-run
    assert "tok1" in stored and "tok2" in stored  # config.yaml (0600): the generators need them


def test_the_run_directory_and_its_config_are_private(tmp_path):
    from asyncrl.run.launch import Launcher

    cfg = load_config(DEMO, {"run.out_dir": str(tmp_path), "buffer.url": "redis://:hunter2@127.0.0.1:1/0"})
    config_path = Launcher(cfg).prepare_run_dir()
    assert stat.S_IMODE(os.stat(cfg.run_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(config_path).st_mode) == 0o600
    assert "hunter2" not in config_path.read_text()


def _module(tmp_path, name: str, source: str) -> dict:
    (tmp_path / f"{name}.py").write_text(source)
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_a_reward_module_with_a_syntax_error_is_one_line(tmp_path):
    env = _module(tmp_path, "badsyntax", "def reward(p, c, r):\n    return (\n")
    proc = asyncrl("launch", "--config", str(DEMO), "--set", "data.reward=badsyntax:reward", "--dry-run", env=env)
    assert_one_line_error(proc, "badsyntax", "SyntaxError", "badsyntax.py:")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_reward_module_that_raises_at_import_is_one_line(tmp_path):
    env = _module(tmp_path, "raising", "raise RuntimeError('no GPU here')\ndef reward(p, c, r):\n    return 0.0\n")
    proc = asyncrl("launch", "--config", str(DEMO), "--set", "data.reward=raising:reward", "--dry-run", env=env)
    assert_one_line_error(proc, "raising", "RuntimeError: no GPU here")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_invalid_yaml_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  name: [unclosed\n  steps: 3\n")
    proc = asyncrl("launch", "--config", str(bad), "--dry-run")
    assert_one_line_error(proc, "bad.yaml", "line")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_model_path_that_is_not_a_model_is_an_error_not_a_demo_build(tmp_path):
    empty = tmp_path / "my-model"
    empty.mkdir()
    proc = asyncrl("launch", "--config", str(DEMO), "--set", f"model.path={empty}", "--dry-run")
    assert_one_line_error(proc, "my-model", "config.json")
    assert not any(empty.iterdir())
    with pytest.raises(UserError, match="typo"):
        from asyncrl.run.preflight import ensure_model

        ensure_model(load_config(DEMO, {"model.path": str(tmp_path / "typo")}), log=lambda _: None)
    assert not (tmp_path / "typo").exists()
