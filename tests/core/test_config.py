"""Config validation, overrides, and the CLI's one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from demo_launch import DEMO, ROOT, assert_one_line_error, asyncrl
from pydantic import ValidationError

from asyncrl.config import Config, dump_config, load_config, parse_override
from asyncrl.errors import UserError


def test_demo_config_is_valid():
    cfg = load_config(DEMO)
    assert cfg.run.learners == 2 and cfg.generator.engine.type == "vllm"
    assert cfg.learner.groups_per_step % cfg.run.learners == 0


def test_overrides_are_parsed_as_yaml_and_applied():
    assert parse_override("learner.lr=1e-5") == ("learner.lr", 1e-5)
    assert parse_override("model.recipe=null") == ("model.recipe", None)
    cfg = load_config(DEMO, {"learner.lr": 1e-5, "run.max_policy_lag": 0})
    assert cfg.learner.lr == 1e-5 and cfg.run.max_policy_lag == 0


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"learner.lr": -1}, "learner.lr"),
        ({"run.max_policy_lag": -1}, "run.max_policy_lag"),
        ({"generator.engine.type": "tgi"}, "generator.engine"),
        ({"learner.typo": 1}, "learner.typo"),
        ({"learner.zero_stage": 4}, "learner.zero_stage"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(UserError, match=field.replace(".", r"\.")):
        load_config(DEMO, overrides)


def test_cross_field_rule_groups_divisible_by_learners():
    with pytest.raises(UserError, match="divisible"):
        load_config(None, {"run.learners": 3, "learner.groups_per_step": 8})


def test_routing_replay_needs_the_engine_that_captures_routes():
    with pytest.raises(UserError, match=r"routing_replay needs generator\.engine\.type=vllm"):
        load_config(None, {"algorithm.routing_replay": True, "generator.engine.type": "hf"})
    assert load_config(None, {"algorithm.routing_replay": True}).algorithm.routing_replay


def test_a_run_evaluates_when_its_generators_may_and_it_has_held_out_prompts():
    """What the engine's slots, the generators' eval points and the launcher's wait for the final eval all read."""
    assert load_config(DEMO).evaluates
    assert not load_config(DEMO, {"generator.eval": False}).evaluates
    assert not load_config(DEMO, {"data.eval": None}).evaluates


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.run.steps = 3  # type: ignore[misc]


def test_bad_override_syntax():
    with pytest.raises(UserError, match="section.field=value"):
        parse_override("learner.lr")


def test_dry_run_prints_resolved_config_and_starts_nothing(tmp_path):
    proc = asyncrl(
        "launch",
        "--config",
        str(DEMO),
        "--generators",
        "3",
        "--max-policy-lag",
        "2",
        "--set",
        f"run.out_dir={tmp_path}",
        "--dry-run",
    )
    assert proc.returncode == 0, proc.stderr
    printed = load_config(None, None).model_validate(__import__("yaml").safe_load(proc.stdout))
    assert printed.run.generators == 3 and printed.run.max_policy_lag == 2
    assert not any(tmp_path.iterdir())


def test_cli_invalid_config_value_exits_2_naming_the_field():
    proc = asyncrl("launch", "--config", str(DEMO), "--set", "learner.lr=-1", "--dry-run")
    assert proc.returncode == 2
    assert_one_line_error(proc, "learner.lr")


def test_cli_missing_dataset():
    proc = asyncrl("launch", "--config", str(DEMO), "--set", "data.train=missing.jsonl", "--dry-run")
    assert_one_line_error(proc, "dataset file not found", "missing.jsonl")


def test_cli_missing_config_file():
    proc = asyncrl("launch", "--config", "nope.yaml", "--dry-run")
    assert_one_line_error(proc, "config file not found")


def test_cli_no_redis_server_binary_says_how_to_install(tmp_path):
    # a PATH without redis-server (python is called by absolute path)
    proc = asyncrl("launch", "--config", str(DEMO), "--dry-run", env={"PATH": str(tmp_path)})
    assert_one_line_error(proc, "redis-server not found", "apt-get install redis-server")


def test_cli_unreachable_redis_url():
    proc = asyncrl("launch", "--config", str(DEMO), "--redis-url", "redis://:secret@127.0.0.1:1/0", "--dry-run")
    assert_one_line_error(proc, "cannot reach Redis", "127.0.0.1:1")
    assert "secret" not in proc.stderr


def test_help_is_fast_and_imports_nothing_heavy():
    code = "import sys, asyncrl.cli; print(any(m in sys.modules for m in ('torch', 'vllm', 'deepspeed')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.stdout.strip() == "False"


def test_config_reference_page_is_generated_from_the_models():
    sys.path.insert(0, str(ROOT / "scripts"))
    import config_reference

    assert config_reference.PAGE == ROOT / "docs" / "configuration.md"
    page = config_reference.PAGE.read_text()
    assert config_reference.page_table(page) == config_reference.render(), (
        "docs/configuration.md's config reference is stale: run `python scripts/config_reference.py --write`"
    )
    for field in ("weights.dir", "generator.engine.kv_cache_gb", "buffer.url", "algorithm.icepop_low"):
        assert f"| `{field}` |" in page


@pytest.mark.parametrize(
    ("overrides", "new"),
    [
        ({"weights.transport": "shm"}, "weights.type"),
        ({"weights.shm_dir": "/tmp"}, "weights.dir"),
        ({"generator.kv_cache_gb": 2}, "generator.engine.kv_cache_gb"),
        ({"generator.on_weight_update": "continue"}, "generator.engine.on_weight_update"),
        ({"buffer.redis_url": "redis://x"}, "buffer.url"),
        ({"generator.engine": "hf"}, "generator.engine.type=hf"),
    ],
)
def test_moved_fields_name_their_new_place(overrides, new):
    with pytest.raises(UserError, match=new.replace(".", r"\.")):
        load_config(DEMO, overrides)


def test_typed_sections_take_only_their_own_fields():
    shm = load_config(None, {"weights.type": "shm", "weights.dir": "/tmp"}).weights
    assert (shm.type, shm.dir, shm.verify) == ("shm", "/tmp", "structure")
    assert load_config(None).weights.type == "zmq"  # the type may be left out: the default backend
    with pytest.raises(UserError, match=r"weights\.dir: unknown field"):
        load_config(None, {"weights.dir": "/tmp"})  # zmq has no directory
    with pytest.raises(UserError, match=r"generator\.engine\.kv_cache_gb: unknown field"):
        load_config(None, {"generator.engine.type": "hf", "generator.engine.kv_cache_gb": 2})
    assert load_config(None, {"generator.engine.type": "hf"}).generator.engine.on_weight_update == "wait"
    with pytest.raises(UserError, match=r"buffer\.url: unknown field"):
        load_config(None, {"buffer.type": "memory", "buffer.url": "redis://x"})


def test_nccl_weights_need_cuda():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match="weights.type=nccl needs CUDA"):
        load_config(None, {"weights.type": "nccl"})


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.name=ppo", "algorithm.normalize_std=true"],
        ["algorithm.correction=icepop", "algorithm.icepop_low=9"],
    ],
)
def test_cli_dry_run_rejects_what_a_learner_would(overrides):
    args = [a for o in overrides for a in ("--set", o)]
    proc = asyncrl("launch", "--config", str(DEMO), *args, "--dry-run")
    assert proc.returncode == 2
    assert_one_line_error(proc, "algorithm")


# ----- episode kinds (issue 45): a typed section whose type old configs name by their one key ---------------

EPISODE_KINDS = [
    ("function", "episode_fixtures:runaway", "function"),
    ("env_url", "http://:tok@127.0.0.1:9", "remote_env"),
    ("agent", "asyncrl.demo.guess_agent:play", "agent"),
    ("agent_command", "python agent.py", "agent_command"),
]


def _episode_yaml(**fields) -> str:
    return "episode:\n" + "".join(f"  {key}: {json.dumps(value)}\n" for key, value in fields.items())


@pytest.mark.parametrize(("key", "value", "kind"), EPISODE_KINDS)
def test_an_episode_without_a_type_is_the_kind_its_one_key_names(key, value, kind):
    old = load_config(None, text=_episode_yaml(**{key: value}))
    assert old.episode.type == kind and getattr(old.episode, key) == value
    assert load_config(None, text=_episode_yaml(type=kind, **{key: value})) == old  # the type form, written out
    assert load_config(None, text=dump_config(old, shown=False)) == old  # what the launcher writes reads back
    assert load_config(None).episode.type == "completion"  # no key: one completion (a tool loop with tools)


def test_an_old_run_config_with_every_kinds_keys_still_loads():
    """The config.yaml of a run launched before episode.type wrote every kind's keys, at null or their
    defaults; and an override may null the file's key to give another (episode.function=null)."""
    old = _episode_yaml(function="asyncrl.demo.guess:Env", env_url=None, agent=None, agent_command=None)
    cfg = load_config(None, text=old + "  agent_host: 127.0.0.1\n  agent_port: 0\n")
    assert cfg.episode.type == "function" and cfg.episode.function == "asyncrl.demo.guess:Env"
    cfg = load_config(DEMO.parent / "demo-guess.yaml", {"episode.function": None, "episode.env_url": "http://h:1"})
    assert cfg.episode.type == "remote_env" and cfg.episode.options == {"latency_s": 0.0, "latency_sigma": 0.0}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"function": "a:b", "agent": "c:d"},
            "episode.function and episode.agent both name the episode: give one, or write episode.type: function "
            "or agent with its key alone",
        ),
        (
            {"type": "agent", "agent": "c:d", "function": "a:b"},
            "episode.function is for episode.type: function, not agent",
        ),
        (
            {"function": "a:b", "agent_port": 8000},
            "episode.agent_port is for episode.type: agent, agent_command or agent_service",
        ),
        ({"type": "env_serve", "env_url": "http://h:1"}, "episode.type 'env_serve' is none of completion, function"),
        ({"type": "function"}, "episode.function: Field required"),
        ({"env_url": "ftp://h"}, "episode.env_url must be an http(s):// URL"),
        ({"agent_command": " "}, "episode.agent_command is empty"),
    ],
)
def test_an_episode_that_names_no_one_kind_fails_in_one_line(fields, message):
    with pytest.raises(UserError) as error:
        load_config(None, text=_episode_yaml(**fields))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_cli_two_episode_keys_exit_2_in_one_line():
    guess = DEMO.parent / "demo-guess.yaml"  # episode.function: asyncrl.demo.guess:Env
    proc = asyncrl("launch", "--config", str(guess), "--set", "episode.agent=a:b", "--dry-run")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert_one_line_error(proc, "episode.function and episode.agent both name the episode", "episode.type:")


def test_an_override_naming_the_episode_makes_it_that_kind_over_a_written_type():
    """A run's config.yaml (and any config dumped from a loaded one) writes ``episode.type``; ``--set
    episode.function=...`` on top of it makes a function episode, as it does on a file that has no type. Naming
    the type too keeps the one-line error of a key of another kind."""
    written = load_config(None, {"episode.max_turns": 3}).model_dump()
    assert written["episode"]["type"] == "completion"
    cfg = load_config(None, {**written, "episode.function": "episode_fixtures:CountingEnv"})
    assert cfg.episode.type == "function" and cfg.episode.max_turns == 3
    cfg = load_config(None, {**cfg.model_dump(), "episode.function": None, "episode.env_url": "http://:t@h:1"})
    assert cfg.episode.type == "remote_env"
    with pytest.raises(UserError, match="episode.function is for episode.type: function, not completion"):
        load_config(None, {**written, "episode.function": "x:y", "episode.type": "completion"})
