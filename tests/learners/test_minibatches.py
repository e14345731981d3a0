"""Several optimizer steps per batch (``learner.minibatches``): pi_prox and V_old are the batch's start.

``train_step.train_step`` runs here on the tiny models of tests/learners/test_loss_split.py behind a stand-in
for the few DeepSpeed engine calls the learner makes (forward, backward, step; SGD, gradients averaged
over ranks as DeepSpeed does), so the mini-batch loop itself is what is tested:

* minibatches = 1 is the one-step path (``objective.step_loss``) exactly;
* minibatches = 2: the first step's gradient is the hand-computed decoupled-PPO one (token TIS under
  the clip too), and the second step's ratio is against pi_prox from BEFORE the first step, so with a
  large lr the clip binds;
* split invariance: 2 gloo ranks with 2 mini-batches each give the parameters of 1 rank.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_on_ranks
from test_loss_split import MAX_LEN, TinyCritic, TinyLM, make_groups

from asyncrl.config import load_config
from asyncrl.config.presets import PRESETS
from asyncrl.learners.batching import pad_batch, sequence_logprobs
from asyncrl.learners.objective import Reducer, StepBatch, step_loss
from asyncrl.learners.train_step import Models, ScoredSampling, train_step

TOL = 1e-6


class FakeEngine:
    """The DeepSpeed engine calls the learner makes, around a float64 module and plain SGD."""

    device = torch.device("cpu")

    def __init__(self, module: torch.nn.Module, lr: float, world: int = 1, lm: bool = True):
        self.module, self.world, self.lm = module, world, lm
        self.opt = torch.optim.SGD(module.parameters(), lr=lr)
        self.losses: list[float] = []
        self.grads: list[torch.Tensor] = []

    def __call__(self, input_ids, attention_mask):
        out = self.module(input_ids)
        return SimpleNamespace(logits=out) if self.lm else out

    def backward(self, loss: torch.Tensor) -> None:
        self.losses.append(float(loss.detach()))
        loss.backward()

    def step(self) -> None:
        for p in self.module.parameters():
            if self.world > 1:  # DeepSpeed averages gradients over the ranks
                dist.all_reduce(p.grad)
                p.grad /= self.world
        self.grads.append(torch.cat([p.grad.flatten().clone() for p in self.module.parameters()]))
        self.opt.step()
        self.opt.zero_grad()

    def params(self) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in self.module.parameters()])


def make_train_batch(groups) -> dict:
    rows = [s for g in groups for s in g]
    batch = pad_batch([(p, r, b) for p, r, b, _ in rows], pad_id=0)
    batch["behaviour_logprobs"] = batch["behaviour_logprobs"].double()
    batch["response_mask"] = batch["response_mask"].double()
    batch["rewards"] = torch.tensor([r for *_, r in rows], dtype=torch.float64)
    batch["group_ids"] = torch.tensor([i for i, g in enumerate(groups) for _ in g])
    batch["same_version"] = torch.zeros_like(batch["response_mask"])
    return batch


def train(preset, groups, minibatches: int, lr: float, reducer=None, world: int = 1, epochs: int = 1):
    cfg = load_config(
        None,
        {
            "learner.groups_per_step": 4,
            "learner.minibatches": minibatches,
            "learner.epochs": epochs,
            "generator.max_new_tokens": MAX_LEN,
        },
    )
    policy = FakeEngine(TinyLM(0), lr, world)
    critic = FakeEngine(TinyCritic(), lr, world, lm=False) if preset.needs_critic else None
    reference = None
    if preset.uses_kl:
        ref = TinyLM(1)
        reference = lambda input_ids, attention_mask: SimpleNamespace(logits=ref(input_ids))  # noqa: E731
    models = Models(policy, critic, reference)
    sampling = ScoredSampling(cfg.generator.temperature, cfg.generator.max_new_tokens)
    out, _ = train_step(models, make_train_batch(groups), preset, cfg.learner, sampling, world, reducer or Reducer())
    return out, models


GRPO = dataclasses.replace(PRESETS["grpo"], kl_coef=0.0, aggregation="token-mean")


@pytest.mark.parametrize("name", ["grpo", "ppo", "reinforce_pp"])
def test_one_minibatch_is_the_one_step_path_exactly(name):
    preset = PRESETS[name]
    groups = make_groups()[:4]
    out, models = train(preset, groups, minibatches=1, lr=0.5)
    # the one-step path by hand: step_loss on one forward, one SGD step
    policy, critic, ref = TinyLM(0), TinyCritic(), TinyLM(1)
    batch = make_train_batch(groups)
    ids = batch["input_ids"]
    with torch.no_grad():
        ref_lp = sequence_logprobs(ref(ids), ids, 1.0) if preset.uses_kl else None
    step = StepBatch(batch["rewards"], batch["group_ids"], batch["response_mask"], batch["behaviour_logprobs"])
    values = critic(ids) if preset.needs_critic else None
    want = step_loss(preset, step, sequence_logprobs(policy(ids), ids, 1.0), Reducer(), 1, MAX_LEN, ref_lp, values)
    assert out.metrics == want.metrics
    want.policy_loss.backward()
    with torch.no_grad():
        for p in policy.parameters():
            p -= 0.5 * p.grad
    assert torch.equal(models.policy.params(), torch.cat([p.detach().flatten() for p in policy.parameters()]))
    assert len(models.policy.losses) == 1


@pytest.mark.parametrize("correction", ["decoupled_ppo", "tis"])
def test_two_minibatches_clip_against_the_policy_from_before_the_first_step(correction):
    """Decoupled PPO, and token TIS under the PPO clip (Truncated IS's composition): both clip
    r = pi / pi_prox and weight min(pi_prox / mu, C)."""
    lr, preset = 20.0, dataclasses.replace(GRPO, correction=correction)
    groups = make_groups()[:4]
    out, models = train(preset, groups, minibatches=2, lr=lr)
    engine = models.policy
    assert len(engine.losses) == 2 and len(engine.grads) == 2
    # by hand: A per group, w = min(pi_prox / mu, C) with pi_prox the initial policy, r = pi / pi_prox
    batch = make_train_batch(groups)
    ids, mask, mu = batch["input_ids"], batch["response_mask"], batch["behaviour_logprobs"]
    rewards = batch["rewards"]
    adv = torch.cat([(r - r.mean()) / (r.std(unbiased=False) + 1e-6) for r in rewards.split(4)])[:, None] * mask
    model = TinyLM(0)
    prox = sequence_logprobs(model(ids), ids, 1.0).detach()
    w = torch.exp(prox - mu).clamp(max=preset.correction_config.tis_cap)
    eps_low, eps_high = preset.loss_config.clip_low, preset.loss_config.clip_high

    def hand_loss(rows):
        lp = sequence_logprobs(model(ids[rows]), ids[rows], 1.0)
        r = torch.exp(lp - prox[rows])
        a, m = adv[rows], mask[rows]
        surrogate = torch.maximum(-r * a, -r.clamp(1 - eps_low, 1 + eps_high) * a)
        clipped = (-r.clamp(1 - eps_low, 1 + eps_high) * a > -r * a) & (m > 0)  # gradient 0
        return (w[rows] * surrogate * m).sum() / m.sum(), float(clipped.sum() / m.sum())

    first, second = slice(0, 8), slice(8, 16)  # groups 0-1, then 2-3 (4 samples each)
    loss1, clip1 = hand_loss(first)
    loss1.backward()
    grad1 = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert abs(engine.losses[0] - float(loss1.detach())) < 1e-12 and clip1 == 0.0
    assert torch.allclose(engine.grads[0], grad1, atol=1e-12, rtol=0)
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    loss2, clip2 = hand_loss(second)
    assert abs(engine.losses[1] - float(loss2.detach())) < 1e-10
    assert clip2 > 0  # the clip binds: the second step's ratio is against the policy before the first
    assert abs(out.metrics["learner/policy_clip_frac"] - (clip1 + clip2) / 2) < 1e-12  # the steps' mean


def test_the_lr_schedule_counts_batches_not_optimizer_steps():
    from asyncrl.learners.deepspeed_engine import lr_lambda

    one = lr_lambda(load_config(None, {"learner.warmup_steps": 2}).learner, 10)
    four = lr_lambda(load_config(None, {"learner.warmup_steps": 2, "learner.minibatches": 4}).learner, 10)
    assert [four(s) for s in range(0, 40, 4)] == [one(s) for s in range(10)]
    assert four(39) == one(9) and four(41) == one(10)


def test_minibatches_must_divide_each_ranks_share():
    from asyncrl.errors import UserError

    with pytest.raises(UserError, match="learner.minibatches"):
        load_config(None, {"learner.groups_per_step": 6, "learner.minibatches": 4})
    assert load_config(None, {"learner.groups_per_step": 8, "learner.minibatches": 4}).learner.minibatches == 4


# ----------------------------------------------------------------------------- split invariance

SPLIT_PRESETS = {"grpo": GRPO, "ppo": PRESETS["ppo"], "reinforce_pp": PRESETS["reinforce_pp"]}
SHARES = ([0, 1], [2, 3])  # rank r's groups; its mini-batch k is its k-th group


def _split_rank(rank: int) -> None:
    from asyncrl.learners.objective import DistReducer

    groups = make_groups()[:4]
    for name, preset in SPLIT_PRESETS.items():
        # one rank: mini-batch k = the union of the ranks' k-th mini-batches (groups 0, 2 then 1, 3)
        full_out, full = train(preset, [groups[i] for i in (0, 2, 1, 3)], 2, lr=5.0, epochs=2)
        out, split = train(preset, [groups[i] for i in SHARES[rank]], 2, 5.0, DistReducer(), world=2, epochs=2)
        for a, b in [(full.policy, split.policy), (full.critic, split.critic)]:
            if a is not None:
                assert len(b.grads) == 4
                diff = (a.params() - b.params()).abs().max()
                assert diff < TOL, (name, float(diff))
        for key, want in full_out.metrics.items():
            assert abs(out.metrics[key] - want) < TOL, (name, key, out.metrics[key], want)
        assert full_out.metrics["learner/policy_clip_frac"] > 0, name
        if preset.needs_critic:  # the value clip around V_old binds too
            assert full_out.metrics["learner/value_clip_frac"] > 0, name


def test_minibatch_steps_are_the_same_on_one_rank_and_split_over_two():
    run_on_ranks(_split_rank, 2)
