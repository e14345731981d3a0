"""A prompt that leaves no room in the model's context (issue 11, defect 9): ``--dry-run`` names its file
and line, and a generator that meets one anyway skips and counts it (its admission slot given back)
instead of dying on every draw."""

from __future__ import annotations

import json
import uuid

import pytest
from demo_launch import DEMO, assert_one_line_error, asyncrl
from generator_common import make_generator, play_groups

from asyncrl import buffers
from asyncrl.config import load_config
from asyncrl.control import RunControl, connect
from asyncrl.demo.model import MAX_POSITIONS
from asyncrl.generators.hf_engine import HfEngine
from asyncrl.keys import run_prefix
from asyncrl.lifetime import live_processes
from asyncrl.protocol import decode_group
from asyncrl.weights import MemoryWeightBus


def write_prompts(path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "abc"}) + "\n" for p in prompts))
    return str(path)


def test_dry_run_names_the_first_prompt_that_does_not_fit(tmp_path, tiny_model_dir):
    long = "sort:" + "a" * MAX_POSITIONS + "="
    train = write_prompts(tmp_path / "train.jsonl", ["sort:cba=", "sort:ba=", long, long])
    proc = asyncrl(
        "launch",
        "--config",
        str(DEMO),
        "--set",
        f"model.path={tiny_model_dir}",
        "--set",
        "model.recipe=null",
        "--set",
        f"data.train={train}",
        "--dry-run",
    )
    assert_one_line_error(proc, "train.jsonl:3", f"context of {MAX_POSITIONS} tokens", "1 more records")


def test_prompts_that_fit_pass(tmp_path, tiny_model_dir):
    train = write_prompts(tmp_path / "train.jsonl", ["sort:cba=", "sort:ba="])
    proc = asyncrl(
        "launch", "--config", str(DEMO), "--set", f"model.path={tiny_model_dir}", "--set", "model.recipe=null",
        "--set", f"data.train={train}", "--dry-run",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


@pytest.mark.redis
def test_a_launch_checks_the_prompts_beside_its_start_and_stops_with_the_same_error(tmp_path, tiny_model_dir):
    """A real launch checks the lengths on a thread while redis and the children start: a dataset that does
    not fit ends the run with the dry run's one-line error (a user error: exit 2), every process stopped, the
    summary failed, and no nanobind dump from the launcher (it keeps triton out: it compiles nothing)."""
    long = "sort:" + "a" * MAX_POSITIONS + "="
    train = write_prompts(tmp_path / "train.jsonl", ["sort:cba=", "sort:ba=", long, long])
    proc = asyncrl(
        "launch", "--config", str(DEMO), "--name", "long", "--set", f"run.out_dir={tmp_path}",
        "--set", f"model.path={tiny_model_dir}", "--set", "model.recipe=null", "--set", f"data.train={train}",
        "--set", "generator.engine.type=hf", "--generators", "1", "--learners", "1",
    )  # fmt: skip
    assert proc.returncode == 2 and "leaked" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("asyncrl: error: ")]
    assert len(errors) == 1 and "train.jsonl:3" in errors[0] and "1 more records" in errors[0], proc.stderr[-3000:]
    assert f"context of {MAX_POSITIONS} tokens" in errors[0]
    assert json.loads((tmp_path / "long" / "summary.json").read_text())["exit_reason"] == "failed"
    assert live_processes(tmp_path / "long") == {}


@pytest.mark.redis
def test_a_generator_skips_and_counts_a_prompt_that_does_not_fit(tmp_path, tiny_model_dir, redis_server):
    long = "sort:" + "a" * MAX_POSITIONS + "="
    train = write_prompts(tmp_path / "train.jsonl", ["sort:cba=", long])
    cfg = load_config(
        None,
        {
            "model.path": str(tiny_model_dir),
            "model.recipe": None,
            "generator.engine.type": "hf",
            "generator.n_samples": 2,
            "generator.max_new_tokens": 4,
            "data.train": train,
            "data.eval": None,
            "data.reward": "asyncrl.demo.sort:reward",
            "learner.groups_per_step": 2,
            "run.learners": 1,
            "run.generators": 1,
        },
    )
    prefix = run_prefix(f"long-{uuid.uuid4().hex[:8]}")
    control = RunControl(connect(redis_server.url), prefix)
    buffer = buffers.setup(cfg.buffer, redis_server.url, prefix)
    engine = HfEngine(cfg.model, seed=0)
    gen = make_generator(
        cfg, engine, control, MemoryWeightBus().subscriber("generator-0", have=0), tiny_model_dir, buffer
    )
    seqs = [buffer.try_start_group(0, cfg.run.max_policy_lag, 2) for _ in range(8)]
    seqs = [s for s in seqs if s is not None]
    play_groups(gen, seqs)  # prompts are drawn by sequence number: some of them are the long one
    groups = [decode_group(e.frame) for e in buffer.read("rank0", 20, 0)]
    prompts = {tuple(g.prompt_ids) for g in groups}
    skipped = gen.stats.prompts_too_long
    assert skipped > 0 and len(groups) == len(seqs) - skipped and len(prompts) == 1
    assert buffer.stats()["abandoned"] == skipped  # their slots are free again
    buffer.close()


def test_the_launchers_check_reads_tokenizer_json_as_transformers_would(tmp_path, tiny_model_dir):
    """The launcher's prompt check (and its stale shared-memory sweep) import neither transformers nor torch
    for a plain tokenizer (issue 28: ~3 CPU-seconds of its start-up): the ``tokenizers`` library encodes
    every id as transformers does, and a tokenizer it cannot vouch for goes to transformers."""
    import shutil
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from asyncrl.data import load_jsonl, prompt_of
    from asyncrl.run.preflight import plain_tokenizer

    light, tok = plain_tokenizer(str(tiny_model_dir)), AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = [prompt_of(r) for r in load_jsonl(DEMO.parent.parent / "data" / "sort" / "train.jsonl")]
    texts += ["<s>cba</s>=", "a <pad> b", " lead", "\n\t x", "", "ünï©ødé 漢字"]
    for special in (True, False):
        assert [light.encode(t, special) for t in texts] == [tok.encode(t, add_special_tokens=special) for t in texts]
    for extra in ({"chat_template": "{{ messages }}"}, {"add_bos_token": True}):
        other = tmp_path / next(iter(extra))
        shutil.copytree(tiny_model_dir, other)
        config = json.loads((other / "tokenizer_config.json").read_text())
        (other / "tokenizer_config.json").write_text(json.dumps({**config, **extra}))
        assert plain_tokenizer(str(other)) is None
    code = (
        "import sys; from asyncrl.config import load_config; from asyncrl.run.preflight import check_prompt_lengths; "
        f"overrides = {{'model.path': {str(tiny_model_dir)!r}, 'model.recipe': None}}; "
        f"check_prompt_lengths(load_config({str(DEMO)!r}, overrides)); "
        "from asyncrl.weights import remove_stale_shm; remove_stale_shm(sys.argv[1]); "
        "print(sorted({'transformers', 'torch'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]
