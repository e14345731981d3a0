"""The weight-sync probe tells a broken sync from the numerics gap of a dtype, with real engines and a real
optimizer step: an engine (vLLM's CPU engine, and the transformers engine) serving bfloat16 weights
disagrees with a float32 learner far beyond float32's 1e-5 with the same version, yet the probe places it at
that version; an engine that loaded only some tensors of the version (every attention and MLP weight left at
the version before: what a name-mapping slip in a weight loader does) is said to be broken, in one line."""

from __future__ import annotations

import logging
import uuid

import pytest
import torch
from generator_common import save_tiny_model
from vllm_common import start_engine

from asyncrl.buffers import run_prefix
from asyncrl.config import load_config
from asyncrl.control import RunControl, connect
from asyncrl.generators.hf_engine import HfEngine
from asyncrl.learners.train_step import probe_logprobs
from asyncrl.observe import probe

STEPS, LR = 5, 1e-3  # a version: a few AdamW steps at the demo's learning rate


def trained(model, ids: list[int]):
    """``model`` after ``STEPS`` AdamW steps on the sequence's negative log-likelihood (the next version)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x = torch.tensor([ids])
    for _ in range(STEPS):
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    return model


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.parametrize("kind", ["transformers", "vllm"])
def test_a_partial_sync_is_told_from_the_bfloat16_numerics_gap(tmp_path, redis_server, caplog, kind):
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_model(tmp_path / "tiny")
    ids = [
        int(t) for t in torch.randint(3, 200, (60,), generator=torch.Generator().manual_seed(3))
    ]  # < 64: the model's
    learner = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = {k: v.clone() for k, v in learner.state_dict().items()}
    previous = probe_logprobs(learner, ids)
    after = trained(learner, ids).state_dict()
    new = probe_logprobs(learner.eval(), ids)

    if kind == "vllm":
        engine = start_engine(model_dir, dtype="bfloat16")
    else:
        cfg = load_config(None, {"model.path": str(model_dir), "model.recipe": None, "model.dtype": "bfloat16"})
        engine = HfEngine(cfg.model, seed=0)

    control = RunControl(connect(redis_server.url), run_prefix(f"numerics-{uuid.uuid4().hex[:8]}"))
    probe.publish(control, 1, new, ids=ids, previous=previous)  # what the learner publishes with version 1

    def served(state) -> dict[str, float]:
        engine.load_weights(state)
        return probe.compare(control, 1, engine.score(ids))

    with caplog.at_level(logging.WARNING, logger="asyncrl.observe.probe"):
        whole = served(after)
        stale = served(before)
        partial = served({k: (before if ".self_attn." in k or ".mlp." in k else after)[k] for k in after})
    control.r.close()
    assert whole["weights/probe_logprob_diff"] > 1e-3  # bfloat16's gap: far above float32's 1e-5
    assert whole["weights/probe_version_fraction"] == pytest.approx(1.0, abs=0.25)
    assert stale["weights/probe_version_fraction"] == pytest.approx(0.0, abs=0.25)
    assert whole["weights/probe_sync_missed"] < probe.MISSED  # what the fit leaves is the dtype's gap
    assert stale["weights/probe_sync_missed"] > probe.MISSED and partial["weights/probe_sync_missed"] > probe.MISSED
    said = [r.getMessage() for r in caplog.records if r.name == "asyncrl.observe.probe"]
    assert len(said) == 2 and all(m.startswith("weight sync of version 1 is broken or stale") for m in said)
    fraction = "weights/probe_version_fraction"
    print(  # the figures, for the record (pytest -s)
        f"gap max {whole['weights/probe_logprob_diff']:.4f} mean {whole['weights/probe_logprob_diff_mean']:.4f}; "
        f"fraction whole {whole[fraction]:.3f} stale {stale[fraction]:.3f} partial {partial[fraction]:.3f}; missed "
        f"{whole['weights/probe_sync_missed']:.2f} {stale['weights/probe_sync_missed']:.0f} "
        f"{partial['weights/probe_sync_missed']:.2f}"
    )
