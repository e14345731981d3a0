"""``model.dtype: bfloat16``: the learner computes in bfloat16 and keeps float32 master weights and optimizer
state in every ZeRO stage (DeepSpeed's wrappers give the AdamW we build float32 copies of the parameters:
FP16_Optimizer's flat groups at stage 0, the ZeRO optimizer's float32 partitions at 1-3), and the log-probs
the loss and the corrections use are float32. Where each lives, by stage: docs/models.md."""

from __future__ import annotations

import os

import pytest
import torch
from generator_common import save_tiny_model
from gloo_ranks import run_on_ranks


def check_stage(rank: int, model_dir: str, stage: int) -> None:
    from asyncrl.config import load_config
    from asyncrl.learners.batching import model_logprobs, pad_batch
    from asyncrl.learners.deepspeed_engine import build_engine

    os.environ.setdefault("LOCAL_RANK", str(rank))  # the launcher sets it for a learner rank
    overrides = {"model.path": model_dir, "model.recipe": None, "model.dtype": "bfloat16"}
    cfg = load_config(None, {**overrides, "learner.zero_stage": stage})
    engine = build_engine(cfg.learner, cfg.model, steps=4)
    # the module computes in bfloat16 (ZeRO-3 keeps each rank's partition as the parameter's ds_tensor)
    held = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    assert {t.dtype for t in held} == {torch.bfloat16}
    # the optimizer DeepSpeed steps (our AdamW) holds float32 masters, not the module's bfloat16 tensors
    inner = engine.optimizer.optimizer
    masters = [p for group in inner.param_groups for p in group["params"]]
    if stage == 3:  # its float32 partitions go into the AdamW's groups only for the length of a step
        masters = engine.optimizer.fp32_partitioned_groups_flat
    assert masters and {p.dtype for p in masters} == {torch.float32}
    batch = pad_batch([([5, 6, 7], [8, 9, 10, 11], [-1.0] * 4, [1.0] * 4)], pad_id=0)
    logprobs = model_logprobs(engine.module, batch["input_ids"], batch["attention_mask"], 1.0, batch["response_mask"])
    assert logprobs.dtype == torch.float32  # bfloat16 logits, upcast before the log-softmax
    engine.backward(-(logprobs * batch["response_mask"]).sum())
    engine.step()
    state = [s for s in inner.state.values() if "exp_avg" in s]
    assert state and {s["exp_avg"].dtype for s in state} == {s["exp_avg_sq"].dtype for s in state} == {torch.float32}
    assert {getattr(p, "ds_tensor", p).dtype for p in engine.module.parameters()} == {torch.bfloat16}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bfloat16_computes_in_bfloat16_over_float32_masters(tmp_path, stage):
    run_on_ranks(check_stage, 1, str(save_tiny_model(tmp_path / "tiny")), stage)
