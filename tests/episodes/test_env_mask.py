"""Environment tokens are context, never gradient, never counted (the agentic wire format's mask).

Every accepted preset x correction x policy loss composes a step on a batch whose responses have
environment tokens between model turns (mask 0, junk log-probs and values there). Against the same
samples with the environment tokens cut out (model tokens packed left), the loss, the value loss and
every metric are equal, the gradient at every model token is equal, and at every environment token
it is exactly 0: the estimators' recurrences step over them, and no count includes them.
Also: ``pad_batch`` turns a sample's model mask into the response mask.
"""

from __future__ import annotations

import itertools
import math
import typing

import numpy as np
import pytest
import torch
from algo_common import config_accepts

from asyncrl.config import AlgorithmConfig, CorrectionName, PolicyLossName, PresetName
from asyncrl.config.presets import from_config
from asyncrl.learners.batching import pad_batch
from asyncrl.learners.objective import Reducer, StepBatch, step_loss

B, T = 4, 9  # two groups of two samples, nine response positions
MAX_LEN = float(T)


def _masks() -> torch.Tensor:
    """Model (1) / environment (0) / padding (0) per position; ragged, environment turns inside."""
    rows = [
        [1, 1, 0, 0, 1, 1, 0, 1, 1],
        [1, 0, 1, 1, 1, 0, 0, 0, 0],  # three model tokens after one environment token, then padding
        [1, 1, 1, 1, 1, 1, 1, 1, 1],
        [0, 0, 1, 0, 1, 1, 1, 0, 0],  # starts with an observation
    ]
    return torch.tensor(rows, dtype=torch.float64)


def _compact(x: torch.Tensor, mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Each row's model positions packed left, the rest ``fill`` (the same samples without env tokens)."""
    out = torch.full_like(x, fill)
    for i in range(x.shape[0]):
        kept = x[i][mask[i] > 0]
        out[i, : len(kept)] = kept
    return out


def _preset(fields: dict):
    return from_config(AlgorithmConfig.model_construct(**{**AlgorithmConfig().model_dump(), **fields}))


# every combination `--dry-run` accepts (the others are rejected before a learner sees them)
COMBINATIONS = [
    fields
    for p, c, loss in itertools.product(
        typing.get_args(PresetName), typing.get_args(CorrectionName), typing.get_args(PolicyLossName)
    )
    if config_accepts(fields := {"name": p, "correction": c, "policy_loss": loss})
]


def _run(preset, mask, lp, mu, values, ref):
    logprobs = lp.clone().requires_grad_()
    v = values.clone().requires_grad_() if preset.needs_critic else None
    batch = StepBatch(
        rewards=torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64),
        group_ids=torch.tensor([0, 0, 1, 1]),
        mask=mask,
        behaviour_logprobs=mu,
    )
    out = step_loss(
        preset, batch, logprobs, Reducer(), 1, MAX_LEN, ref_logprobs=ref if preset.uses_kl else None, values=v
    )
    total = out.policy_loss + (out.value_loss if out.value_loss is not None else 0.0)
    total.backward()
    return out, logprobs.grad, (v.grad if v is not None else None)


@pytest.mark.parametrize("fields", COMBINATIONS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_environment_tokens_are_context_only(fields):
    preset = _preset(fields)
    g = torch.Generator().manual_seed(0)
    mask = _masks()
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) - 0.1
    mu = lp - 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.rand(B, T, generator=g, dtype=torch.float64)
    ref = lp - 0.1 * torch.rand(B, T, generator=g, dtype=torch.float64)
    junk = torch.where(mask > 0, 0.0, 1e30)  # what environment positions carry must not matter
    full = _run(preset, mask, lp, mu + junk, values + junk, ref + junk)
    cut_mask = _compact(mask, mask)
    cut = _run(preset, cut_mask, _compact(lp, mask), _compact(mu, mask), _compact(values, mask), _compact(ref, mask))
    assert full is not None and cut is not None
    (out, grad, vgrad), (out_cut, grad_cut, vgrad_cut) = full, cut
    assert math.isclose(
        float(out.policy_loss.detach()), float(out_cut.policy_loss.detach()), rel_tol=1e-9, abs_tol=1e-12
    )
    if out.value_loss is not None:
        assert math.isclose(
            float(out.value_loss.detach()), float(out_cut.value_loss.detach()), rel_tol=1e-9, abs_tol=1e-12
        )
    assert out.metrics.keys() == out_cut.metrics.keys()
    for key, value in out.metrics.items():
        assert math.isclose(value, out_cut.metrics[key], rel_tol=1e-9, abs_tol=1e-12), key
    for got, want in ((grad, grad_cut), (vgrad, vgrad_cut)):
        if got is None:
            continue
        assert torch.equal(got[mask == 0], torch.zeros_like(got[mask == 0]))  # exactly no gradient
        assert torch.allclose(_compact(got, mask), want, rtol=1e-9, atol=1e-12)


def test_pad_batch_takes_the_model_mask_as_the_response_mask():
    prompt = np.array([3, 4], np.int32)
    response = np.array([5, 6, 7, 8], np.int32)
    blp = np.array([-0.5, 9.0, 9.0, -0.25], np.float32)  # junk at the environment tokens
    mask = np.array([1, 0, 0, 1], np.uint8)
    batch = pad_batch([(prompt, response, blp, mask), (prompt, response[:1], blp[:1])], pad_id=0)
    assert batch["input_ids"][0].tolist() == [3, 4, 5, 6, 7, 8]  # observation tokens stay in the context
    assert batch["response_mask"][0].tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]
    assert batch["behaviour_logprobs"][0].tolist() == [0.0, -0.5, 0.0, 0.0, -0.25]
    assert batch["response_mask"][1].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]  # no mask: every token the model's
    with pytest.raises(ValueError, match="mask of 3"):
        pad_batch([(prompt, response, blp, mask[:3])], pad_id=0)
