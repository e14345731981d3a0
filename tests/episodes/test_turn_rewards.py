"""Per-turn rewards of multi-turn episodes: recorded at each turn's last model token, carried on the
wire, placed in the learner's batch, and credited turn by turn by the token-level estimators
(REINFORCE++, REINFORCE++-baseline, GAE) while group estimators see the episode's total."""

from __future__ import annotations

import asyncio

import episode_fixtures as fx
import numpy as np
import pytest
import torch
from test_episodes import make_ctx, scripted

from asyncrl.config.presets import get_preset
from asyncrl.episodes.api import env_episode, run_episode
from asyncrl.learners.advantages import AdvantageConfig, AdvantageInput, get_advantage, token_level_rewards
from asyncrl.learners.batching import make_batch
from asyncrl.protocol import ProtocolError, Sample, TrajectoryGroup, decode_group, encode_group

# one episode: model turn (tokens 0-1), observation (2), model turn (3-4), then padding (5)
MASK = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
TURNS = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0, 0.0]], dtype=torch.float64)


def test_each_turns_reward_lands_on_its_last_token_and_the_rest_on_the_last():
    r = token_level_rewards(torch.tensor([3.5], dtype=torch.float64), MASK, turn_rewards=TURNS)
    assert r.tolist() == [[0.0, 1.0, 0.0, 0.0, 2.5, 0.0]]  # 0.5 of R (shaping) is no turn's
    assert token_level_rewards(torch.tensor([3.0], dtype=torch.float64), MASK).tolist() == [
        [0.0, 0.0, 0.0, 0.0, 3.0, 0.0]
    ]


def test_reinforce_pp_credits_each_turn_with_the_rewards_from_it_on():
    """G_t = sum_{k >= t} gamma^k r_{t+k} over response tokens, then whitened over the batch."""
    rewards = torch.tensor([3.0, 1.0], dtype=torch.float64)
    mask = torch.cat([MASK, MASK])
    turns = torch.cat([TURNS, torch.zeros_like(TURNS)])
    out = get_advantage("reinforce_pp")(AdvantageInput(rewards, mask, turn_rewards=turns), AdvantageConfig(gamma=1.0))
    want = torch.tensor([[3.0, 3.0, 0.0, 2.0, 2.0, 0.0], [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(out.returns, want)
    on = mask > 0
    mean, std = want[on].mean(), want[on].std(unbiased=False)
    assert torch.allclose(out.advantages[on], (want[on] - mean) / (std + 1e-6))


def test_gae_sees_the_turn_rewards():
    values = torch.zeros_like(MASK)
    out = get_advantage("gae")(
        AdvantageInput(torch.tensor([3.0], dtype=torch.float64), MASK, values=values, turn_rewards=TURNS),
        AdvantageConfig(gamma=1.0, lam=1.0),
    )
    assert out.advantages.tolist() == [[3.0, 3.0, 0.0, 2.0, 2.0, 0.0]]


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_see_the_total(name):
    rewards = torch.tensor([3.0, 1.0], dtype=torch.float64)
    mask, ids = torch.cat([MASK, MASK]), torch.tensor([0, 0])
    turns = torch.cat([TURNS, torch.zeros_like(TURNS)])
    plain = get_advantage(name)(AdvantageInput(rewards, mask, ids), AdvantageConfig())
    split = get_advantage(name)(AdvantageInput(rewards, mask, ids, turn_rewards=turns), AdvantageConfig())
    assert torch.equal(plain.advantages, split.advantages)


def _sample(turn_rewards) -> Sample:
    return Sample(
        tokens=np.array([5, 6, 7, 8, 9], np.int32),
        logprobs=np.array([-0.1, -0.2, 0.0, -0.3, -0.4], np.float32),
        versions=np.array([1, 1, -1, 2, 2], np.int32),
        reward=3.0,
        mask=np.array([1, 1, 0, 1, 1], np.uint8),
        turns=2,
        turn_rewards=turn_rewards,
    )


def test_the_wire_carries_turn_rewards_and_refuses_them_on_environment_tokens():
    group = TrajectoryGroup(np.array([1, 2], np.int32), [_sample(np.array([0, 1, 0, 0, 2], np.float32))], 0, 0, "g")
    got = decode_group(encode_group(group)).samples[0]
    assert got.turn_rewards.tolist() == [0, 1, 0, 0, 2]
    plain = TrajectoryGroup(np.array([1, 2], np.int32), [_sample(None)], 0, 0, "g")
    assert decode_group(encode_group(plain)).samples[0].turn_rewards is None
    bad = TrajectoryGroup(np.array([1, 2], np.int32), [_sample(np.array([0, 0, 1, 0, 2], np.float32))], 0, 0, "g")
    with pytest.raises(ProtocolError, match="environment tokens"):
        decode_group(encode_group(bad))


def test_an_env_episode_credits_each_turn_at_its_last_model_token():
    ctx = make_ctx(scripted("ab", "abc"))
    out = asyncio.run(run_episode(env_episode(fx.CountingEnv, max_turns=5), ctx, 60))
    assert out.parts == {"reward": 2.0}
    ends = [i for i in range(len(ctx.mask)) if ctx.mask[i] and (i + 1 == len(ctx.mask) or not ctx.mask[i + 1])]
    assert [i for i, _ in ctx.turn_rewards] == ends and [r for _, r in ctx.turn_rewards] == [1.0, 1.0]


def test_the_learner_batch_aligns_turn_rewards_with_the_response_mask():
    prompt = np.array([1, 2], np.int32)
    groups = [
        TrajectoryGroup(prompt, [_sample(np.array([0, 1, 0, 0, 2], np.float32)), _sample(None)], 0, 0, "g"),
    ]
    batch = make_batch(groups, max_len=16, preset=get_preset("grpo"), pad_id=0, version=2)
    # position j predicts token j + 1: response token t sits at P - 1 + t
    assert batch["turn_rewards"][0].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 2.0]
    assert batch["turn_rewards"][1].tolist() == [0.0] * 6
    assert batch["response_mask"][0].tolist() == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
