"""The learner's side of the algorithms: config -> preset, reward shaping, the demo's loss, the critic.

The maths of every piece is tested against slow references in tests/test_algorithms_*.py; the split
invariance of the composed step in tests/learners/test_loss_split.py.
"""

from __future__ import annotations

import dataclasses
import typing

import numpy as np
import pytest
import torch
from gloo_ranks import run_on_ranks
from hypothesis import given
from hypothesis import strategies as st

from asyncrl import config as config_mod
from asyncrl.config import AlgorithmConfig, load_config
from asyncrl.config.presets import PRESETS, from_config, get_preset
from asyncrl.errors import UserError
from asyncrl.learners.advantages import ADVANTAGES, overlong_penalty
from asyncrl.learners.corrections import CORRECTIONS
from asyncrl.learners.kl import KL_ESTIMATORS
from asyncrl.learners.objective import Reducer, StepBatch, step_loss
from asyncrl.learners.policy_losses import AGGREGATIONS, POLICY_LOSSES
from asyncrl.protocol import Sample, TrajectoryGroup

# ----------------------------------------------------------------------------- config -> preset


def test_config_choices_match_the_registries():
    def choices(alias) -> set[str]:
        return set(typing.get_args(alias))

    assert choices(config_mod.PresetName) == set(PRESETS)
    assert choices(config_mod.AdvantageName) == set(ADVANTAGES)
    assert choices(config_mod.PolicyLossName) == set(POLICY_LOSSES)
    assert choices(config_mod.AggregationName) == set(AGGREGATIONS)
    assert choices(config_mod.CorrectionName) == set(CORRECTIONS)
    field = AlgorithmConfig.model_fields["kl_estimator"].annotation
    assert set(typing.get_args(typing.get_args(field)[0])) == set(KL_ESTIMATORS)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("name", "a2c", "'dapo'"),
        ("correction", "is", "'decoupled_ppo'"),
        ("aggregation", "mean", "'seq-mean-token-sum'"),
        ("kl_estimator", "k4", "'k3'"),
    ],
)
def test_a_bad_name_is_a_user_error_naming_the_field_and_the_choices(field, value, named):
    with pytest.raises(UserError, match=f"algorithm.{field}") as err:
        load_config(None, {f"algorithm.{field}": value})
    assert named in str(err.value) and repr(value) in str(err.value)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_name_alone_gives_the_preset(name):
    assert from_config(AlgorithmConfig(name=name)) == get_preset(name)


def test_every_piece_can_be_set_by_hand():
    algo = load_config(
        None,
        {
            "algorithm.name": "ppo",
            "algorithm.correction": "vtrace",
            "algorithm.rho_bar": 1.5,
            "algorithm.clip_high": 0.3,
            "algorithm.dual_clip": 3.0,
            "algorithm.kl_placement": "loss",
            "algorithm.kl_estimator": "k3",
            "algorithm.kl_coef": 0.0,
            "algorithm.value_clip": 0.5,
            "algorithm.lam": 0.9,
            "algorithm.overlong_buffer": 0.25,
        },
    ).algorithm
    p = from_config(algo)
    assert (p.advantage, p.correction, p.kl_placement, p.kl_estimator, p.kl_coef) == ("gae", "vtrace", "loss", "k3", 0)
    assert (p.loss_config.clip_low, p.loss_config.clip_high, p.loss_config.dual_clip) == (0.2, 0.3, 3.0)
    assert (p.correction_config.rho_bar, p.value_clip, p.advantage_config.lam, p.overlong_buffer) == (
        1.5,
        0.5,
        0.9,
        0.25,
    )
    assert not p.uses_kl and p.needs_critic
    # a critic asked for by hand (vtrace on a critic-free preset) is trained
    by_hand = from_config(AlgorithmConfig(name="grpo", correction="vtrace"))
    assert by_hand.needs_critic and by_hand.value_coef > 0


def test_the_old_fields_keep_working():
    assert from_config(AlgorithmConfig(tis_cap=3.0)).correction_config.tis_cap == 3.0
    assert from_config(AlgorithmConfig(normalize_std=False)).advantage == "dr_grpo"
    assert from_config(AlgorithmConfig(name="dr_grpo", normalize_std=True)).advantage == "grpo"
    assert from_config(AlgorithmConfig(adv_eps=1e-3)).advantage_config.eps == 1e-3
    with pytest.raises(UserError, match="normalize_std"):
        from_config(
            AlgorithmConfig.model_construct(**{**AlgorithmConfig().model_dump(), "name": "ppo", "normalize_std": False})
        )
    with pytest.raises(UserError, match="normalize_std"):
        load_config(None, {"algorithm.name": "ppo", "algorithm.normalize_std": False})
    with pytest.raises(UserError, match="normalize_std"):
        load_config(None, {"algorithm.advantage": "rloo", "algorithm.normalize_std": True})
    with pytest.raises(UserError, match="icepop_low"):
        load_config(None, {"algorithm.icepop_low": 3.0, "algorithm.icepop_high": 2.0})


def test_dapo_is_clip_higher_dynamic_filtering_token_mean_and_overlong_punishment():
    p = get_preset("dapo")
    assert (p.loss_config.clip_low, p.loss_config.clip_high, p.aggregation) == (0.2, 0.28, "token-mean")
    assert p.dynamic_filtering and p.overlong_buffer == 0.2 and not p.uses_kl


# ----------------------------------------------------------------------------- reward shaping


def ref_overlong(length: int, max_len: int, buffer: float, penalty: float) -> float:
    """DAPO eq. 13 with L_max = the generation limit and L_cache = buffer * L_max."""
    cache = buffer * max_len
    if cache == 0 or length <= max_len - cache:
        return 0.0
    if length <= max_len:
        return ((max_len - cache) - length) / cache * penalty
    return -penalty


@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=20),
    max_len=st.integers(1, 40),
    buffer=st.sampled_from([0.0, 0.1, 0.2, 0.5, 0.99]),
    penalty=st.floats(0, 2),
)
def test_overlong_penalty_matches_the_paper(lengths, max_len, buffer, penalty):
    lengths = [min(x, max_len) for x in lengths]  # a response never exceeds the generation limit
    got = overlong_penalty(torch.tensor(lengths), max_len, buffer, penalty)
    want = [ref_overlong(x, max_len, buffer, penalty) for x in lengths]
    assert np.allclose(got.numpy(), want, atol=1e-12, rtol=0)


def test_make_batch_shapes_rewards_and_groups():
    from asyncrl.learners.batching import make_batch

    cfg = load_config(None, {"generator.max_new_tokens": 10, "algorithm.name": "dapo"})

    def sample(n: int, reward: float) -> Sample:
        return Sample(np.arange(n, dtype=np.int32), np.full(n, -1.0, np.float32), np.zeros(n, np.int32), reward)

    groups = [
        TrajectoryGroup(np.array([1, 2], np.int32), [sample(3, 1.0), sample(10, 1.0)], 0, 0, "g"),
        TrajectoryGroup(np.array([3], np.int32), [sample(9, 0.0)], 1, 0, "g"),
    ]
    batch = make_batch(groups, cfg.generator.max_new_tokens, cfg.algorithm.preset, pad_id=0, version=0)
    # L_cache = 2 tokens: length 10 (the limit) gets -1, length 9 gets -0.5
    assert batch["rewards"].tolist() == [1.0, 0.0, -0.5]
    assert batch["group_ids"].tolist() == [0, 0, 1]
    assert batch["response_mask"].sum(dim=1).tolist() == [3, 10, 9]


# ----------------------------------------------------------------------------- the demo's algorithm


def test_the_demo_config_is_exactly_the_earlier_grpo_with_token_tis():
    """ppo_clip + decoupled PPO with one step per batch == token-TIS policy gradient (loss and gradient)."""
    preset = from_config(load_config("configs/demo-cpu.yaml").algorithm)
    assert not preset.uses_kl and preset.aggregation == "token-mean"
    g = torch.Generator().manual_seed(3)
    b, t = 8, 7
    mask = (torch.arange(t)[None] < torch.randint(1, t + 1, (b, 1), generator=g)).double()
    logits = torch.randn(b, t, requires_grad=True, dtype=torch.float64, generator=g)
    behaviour = torch.randn(b, t, dtype=torch.float64, generator=g).clamp(-3, 0) - 0.5
    rewards = torch.randint(0, 2, (b,), generator=g).double()
    groups = torch.arange(b) // 4

    lp = torch.nn.functional.logsigmoid(logits)  # any differentiable log-prob
    out = step_loss(preset, StepBatch(rewards, groups, mask, behaviour), lp, Reducer(), ranks=1, max_len=t)
    (new,) = torch.autograd.grad(out.policy_loss, logits, retain_graph=True)

    # token-TIS policy gradient by hand: l_t = -w_t A_i pi / sg(pi), w_t = min(pi / mu, 2), token mean
    adv = torch.cat([(r - r.mean()) / (r.std(unbiased=False) + 1e-6) for r in rewards.split(4)])
    log_rho = torch.where(mask > 0, lp.detach() - behaviour, 0.0)
    w = torch.exp(log_rho).clamp(max=2.0)
    loss = (-w * adv[:, None] * torch.exp(lp - lp.detach()) * mask).sum() / mask.sum()
    (want,) = torch.autograd.grad(loss, logits)
    assert torch.allclose(out.policy_loss, loss, atol=1e-12) and torch.allclose(new, want, atol=1e-12)
    n = float(mask.sum())
    behaviour_kl = float(((torch.expm1(log_rho) - log_rho) * mask).sum()) / n
    assert abs(out.metrics["learner/behaviour_kl"] - behaviour_kl) < 1e-12
    assert abs(out.metrics["learner/decoupled_ppo_clip_frac"] - float(((log_rho.exp() > 2.0) * mask).sum()) / n) < 1e-12


# ----------------------------------------------------------------------------- critic checkpoint


def _critic_round_trip(rank: int, model_path: str, run_dir: str) -> None:
    import os
    from pathlib import Path

    os.environ.update(LOCAL_RANK="0")
    from asyncrl.learners.deepspeed_engine import build_engine, load_committed, save_checkpoint
    from asyncrl.learners.models import build_critic

    cfg = load_config(None, {"model.path": model_path, "algorithm.name": "ppo", "learner.zero_stage": 0})
    policy, critic = build_engine(cfg.learner, cfg.model, 10), build_critic(cfg.learner, cfg.model, 10, None)
    ids = torch.tensor([[1, 5, 7, 9, 2]])
    mask = torch.ones_like(ids)
    values = critic(ids, mask)
    assert values.shape == (1, 4)
    critic.backward(((values - 1.0) ** 2).mean())
    critic.step()  # the head moves off zero
    saved = critic(ids, mask).detach()
    save_checkpoint(policy, Path(run_dir), 3, {}, critic=critic)
    fresh_policy, fresh_critic = (
        build_engine(cfg.learner, cfg.model, 10),
        build_critic(cfg.learner, cfg.model, 10, None),
    )
    assert not torch.allclose(fresh_critic(ids, mask), saved)
    version, _ = load_committed(fresh_policy, Path(run_dir), critic=fresh_critic)
    assert version == 3 and torch.allclose(fresh_critic(ids, mask), saved, atol=1e-6)


@pytest.mark.slow
def test_the_critic_is_checkpointed_and_restored_with_the_policy(tmp_path):
    pytest.importorskip("deepspeed")
    from demo_launch import ROOT

    model = ROOT / ".cache/models/demo-sort"
    if not model.is_dir():
        pytest.skip("the demo model is built by the first demo launch (asyncrl prepare-demo)")
    run_on_ranks(_critic_round_trip, 1, str(model), str(tmp_path))


def test_presets_are_still_frozen_dataclasses():
    assert dataclasses.is_dataclass(get_preset("ppo"))
