"""Junk in padded slots never leaks in: every registered piece, and the composed step of every preset.

Each piece runs twice on the same response tokens: once with every padded slot of every (B, T) input
holding 0 (clean), once holding junk (nan, inf, -inf, +-1e30). Outputs, metrics and gradients must be
finite and EQUAL to the clean run's: a padded slot is replaced before it is used, so the junk reaches
neither a value nor a backward formula (0 * inf = NaN in a backward is what leaked before).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from algo_common import DTYPES

from asyncrl.config.presets import PRESETS
from asyncrl.learners.advantages import ADVANTAGES, AdvantageConfig, AdvantageInput
from asyncrl.learners.corrections import CORRECTIONS, CorrectionConfig, CorrectionInput
from asyncrl.learners.kl import KL_ESTIMATORS, KLInput, kl_loss, kl_penalty, kl_reward
from asyncrl.learners.objective import Reducer, StepBatch, step_loss
from asyncrl.learners.policy_losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    LossCounts,
    PolicyLossConfig,
    PolicyLossInput,
    ValueLossInput,
    aggregate,
    value_loss,
)

torch.set_num_threads(1)

JUNK = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30]
B, T = 6, 7
COUNTS = LossCounts(num_tokens=20.0, num_sequences=float(B), max_len=float(T))


def make_data() -> dict[str, np.ndarray]:
    """Ragged response windows anywhere in a row (one row empty), two groups of three."""
    rng = np.random.default_rng(0)
    mask = np.zeros((B, T))
    for i, (start, stop) in enumerate([(0, 7), (2, 5), (1, 2), (3, 7), (0, 0), (4, 6)]):
        mask[i, start:stop] = 1.0
    logp = rng.uniform(-3, -0.1, size=(B, T))
    return {
        "mask": mask,
        "logp": logp,
        "mu": logp + rng.normal(0, 0.3, size=(B, T)),
        "prox": logp + rng.normal(0, 0.1, size=(B, T)),
        "ref": logp + rng.normal(0, 0.2, size=(B, T)),
        "adv": rng.normal(size=(B, T)),
        "weights": rng.uniform(0, 2, size=(B, T)),
        "values": rng.normal(size=(B, T)),
        "old_values": rng.normal(size=(B, T)),
        "token_rewards": rng.normal(0, 0.1, size=(B, T)),
        "returns": rng.normal(size=(B, T)),
        "turn_rewards": rng.normal(size=(B, T)),
        "rewards": np.array([0.7, 0.2, 0.7, 1.0, 0.0, 0.5]),
        "group_ids": np.array([0, 0, 0, 1, 1, 1]),
    }


DATA = make_data()


class Padded:
    """(B, T) inputs with ``fill`` in every padded slot, in ``dtype``; (B,) inputs as they are."""

    def __init__(self, fill: float, dtype: torch.dtype):
        self.fill, self.dtype = fill, dtype
        self.mask = torch.tensor(DATA["mask"], dtype=dtype)

    def __call__(self, key: str, grad: bool = False) -> torch.Tensor:
        x = DATA[key]
        if x.ndim == 2:
            x = np.where(DATA["mask"] > 0, x, self.fill)
        return torch.tensor(x, dtype=self.dtype if x.dtype.kind == "f" else None, requires_grad=grad)


def assert_same(clean, junk, what: str) -> None:
    """Finite and equal, through tensors, floats, dicts, dataclasses and tuples."""
    if isinstance(clean, torch.Tensor):
        assert torch.isfinite(junk).all(), (what, junk)
        assert torch.equal(clean, junk), (what, clean, junk)
    elif isinstance(clean, float):
        assert math.isfinite(junk) and junk == clean, (what, clean, junk)
    elif isinstance(clean, dict):
        assert clean.keys() == junk.keys(), what
        for k in clean:
            assert_same(clean[k], junk[k], f"{what}.{k}")
    elif dataclasses.is_dataclass(clean):
        for f in dataclasses.fields(clean):
            assert_same(getattr(clean, f.name), getattr(junk, f.name), f"{what}.{f.name}")
    elif isinstance(clean, tuple | list):
        for k, (a, b) in enumerate(zip(clean, junk, strict=True)):
            assert_same(a, b, f"{what}[{k}]")
    else:
        assert clean == junk, (what, clean, junk)


def both(run, dtype: torch.dtype, junk: float) -> None:
    """run(Padded) -> outputs; compared between clean and junk padding."""
    assert_same(run(Padded(0.0, dtype)), run(Padded(junk, dtype)), run.__name__)


# ----------------------------------------------------------------------------- pieces


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("junk", JUNK)
@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_advantage_estimators(name, junk, dtype):
    def advantages(p: Padded):
        inp = AdvantageInput(
            p("rewards"), p.mask, p("group_ids"), p("token_rewards"), p("values"), turn_rewards=p("turn_rewards")
        )
        return ADVANTAGES[name](inp, AdvantageConfig(gamma=0.9, lam=0.8))

    both(advantages, dtype, junk)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("junk", JUNK)
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_losses(name, junk, dtype):
    def policy_loss(p: Padded):
        lp = p("logp", grad=True)
        out = POLICY_LOSSES[name](
            PolicyLossInput(lp, p("prox"), p("adv"), p.mask, p("weights")), PolicyLossConfig(dual_clip=3.0)
        )
        aggregate("token-mean", out.token_loss, p.mask, COUNTS).backward()
        return out, lp.grad

    both(policy_loss, dtype, junk)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("junk", JUNK)
@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_aggregations(name, junk, dtype):
    def aggregation(p: Padded):
        token_loss = p("adv", grad=True)
        loss = AGGREGATIONS[name](token_loss, p.mask, COUNTS)
        loss.backward()
        return loss, token_loss.grad

    both(aggregation, dtype, junk)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("junk", JUNK)
@pytest.mark.parametrize(
    ("name", "with_prox"),
    [(n, p) for n in sorted(CORRECTIONS) for p in (False, True) if p or n != "decoupled_ppo"],  # it needs pi_prox
)
def test_corrections(name, with_prox, junk, dtype):

    def correction(p: Padded):
        inp = CorrectionInput(
            p("logp"),
            p("mu"),
            p.mask,
            p("prox") if with_prox else None,
            rewards=p("token_rewards"),
            values=p("values"),
            bootstrap_value=p("rewards"),
        )
        return CORRECTIONS[name](inp, CorrectionConfig(geo_low=0.5, geo_high=2.0))

    both(correction, dtype, junk)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("junk", JUNK)
@pytest.mark.parametrize("estimator", sorted(KL_ESTIMATORS))
def test_kl_estimators(estimator, junk, dtype):
    def kl(p: Padded):
        lp = p("logp", grad=True)
        inp = KLInput(lp, p("ref"), p.mask)
        loss = kl_loss(inp, estimator, 0.1, p("weights"))
        aggregate("token-mean", loss, p.mask, COUNTS).backward()
        return loss.detach(), kl_penalty(inp, estimator).detach(), kl_reward(inp, estimator, 0.1), lp.grad

    both(kl, dtype, junk)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("junk", JUNK)
@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss(clip, junk, dtype):
    def critic(p: Padded):
        values = p("values", grad=True)
        out = value_loss(ValueLossInput(values, p("old_values"), p("returns"), p.mask), clip)
        aggregate("token-mean", out.token_loss, p.mask, COUNTS).backward()
        return out, values.grad

    both(critic, dtype, junk)


# ----------------------------------------------------------------------------- the composed step


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("junk", JUNK)
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_step_loss_of_every_preset(name, junk, dtype):
    preset = dataclasses.replace(PRESETS[name], kl_coef=PRESETS[name].kl_coef or 0.05)  # a reference model too

    def step(p: Padded):
        lp = p("logp", grad=True)
        values = p("values", grad=True) if preset.needs_critic else None
        batch = StepBatch(p("rewards"), p("group_ids"), p.mask, p("mu"))
        out = step_loss(preset, batch, lp, Reducer(), 1, float(T), p("ref") if preset.uses_kl else None, values)
        total = out.policy_loss + (out.value_loss if out.value_loss is not None else 0.0)
        total.backward()
        return out, lp.grad, None if values is None else values.grad

    both(step, dtype, junk)
