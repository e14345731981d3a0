"""``--dry-run`` rejects exactly what a learner rejects: every preset x correction x policy loss (and
parameter settings that only a resolved preset can judge), validated both ways.

* the config's way: ``load_config`` (what ``asyncrl launch --dry-run`` runs);
* the learner's way, as a rank did it before the preset moved into the config: the preset expanded by
  ``presets.from_config`` from an UNVALIDATED section, then one real ``objective.step_loss`` on a small
  batch, backward included.
"""

from __future__ import annotations

import itertools
import typing

import pytest
import torch
from algo_common import config_accepts

from asyncrl.config import AlgorithmConfig, CorrectionName, PolicyLossName, PresetName
from asyncrl.config.presets import from_config
from asyncrl.errors import UserError
from asyncrl.learners.objective import Reducer, StepBatch, step_loss

B, T = 4, 5  # two groups of two samples, five token positions


def learner_accepts(fields: dict) -> bool:
    try:
        preset = from_config(AlgorithmConfig.model_construct(**{**AlgorithmConfig().model_dump(), **fields}))
    except UserError:
        return False
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 3:] = 0  # ragged
    logprobs = (-torch.rand(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    values = torch.rand(B, T, generator=g, dtype=torch.float64).requires_grad_() if preset.needs_critic else None
    ref = -torch.rand(B, T, generator=g, dtype=torch.float64) if preset.uses_kl else None
    batch = StepBatch(
        rewards=torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64),
        group_ids=torch.tensor([0, 0, 1, 1]),
        mask=mask,
        behaviour_logprobs=logprobs.detach() - 0.01,
    )
    try:
        out = step_loss(preset, batch, logprobs, Reducer(), 1, float(T), ref_logprobs=ref, values=values)
        loss = out.policy_loss + (out.value_loss if out.value_loss is not None else 0.0)
        loss.backward()
    except (ValueError, UserError):
        return False
    assert torch.isfinite(logprobs.grad).all()
    return True


COMBINATIONS = [
    {"name": p, "correction": c, "policy_loss": loss}
    for p, c, loss in itertools.product(
        typing.get_args(PresetName), typing.get_args(CorrectionName), typing.get_args(PolicyLossName)
    )
]
PARAMETERS = [
    {"name": "ppo", "normalize_std": True},
    {"name": "grpo", "normalize_std": False},
    {"name": "grpo", "correction": "icepop", "icepop_low": 9.0},
    {"name": "grpo", "correction": "geo_mask", "geo_low": 2.0, "geo_high": 1.5},
    {"name": "grpo", "advantage": "gae"},
    {"name": "rloo", "clip_low": 0.3, "clip_high": 0.1},
    {"name": "dapo", "dual_clip": 3.0},
]


@pytest.mark.parametrize("fields", COMBINATIONS + PARAMETERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_dry_run_and_learner_agree(fields):
    assert config_accepts(fields) == learner_accepts(fields)


def test_both_ways_reject_something():
    """The agreement above is not vacuous: some settings are rejected, most combinations accepted."""
    verdicts = [config_accepts(f) for f in COMBINATIONS + PARAMETERS]
    assert not all(verdicts) and sum(verdicts) > len(COMBINATIONS) // 2
