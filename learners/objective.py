"""How one learner step composes a preset's pieces into the losses to backpropagate (pure torch).

For one rank's share of the step (whole groups: group statistics never cross ranks), in order:

  1. counts      N_tok, N_seq summed over ranks -> ``LossCounts`` divided by the rank count, because
                 DeepSpeed AVERAGES gradients over ranks: the applied gradient is the full batch's
  2. KL reward   kl_placement = reward: token_rewards = -beta k(pi, pi_ref), detached
  3. advantages  the preset's estimator; batch moments (REINFORCE++) are all-reduced over ranks
  4. correction  weights w and the ratio's anchor from mu (behaviour), pi and pi_prox; V-trace's own
                 advantages and value targets replace those of step 3 when it supplies them
  5. policy loss + KL loss (kl_placement = loss, weighted by w), aggregated by the preset's rule
  6. value loss  the critic's (value clipping around the values of this forward), same aggregation
  7. metrics     token-weighted sums (and maxima) over ranks: the numbers describe the whole step

Every normaliser is global, so the loss and gradient of a step do not depend on how its groups are
split across ranks (tests/test_loss_split.py checks 1 rank vs 2 gloo ranks to 1e-6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.learners.advantages import AdvantageInput, MomentsFn, get_advantage, token_level_rewards
from asyncrl.learners.corrections import CorrectionInput, get_correction
from asyncrl.learners.kl import KLInput, kl_loss, kl_penalty, kl_reward
from asyncrl.learners.policy_losses import (
    LossCounts,
    PolicyLossInput,
    ValueLossInput,
    aggregate,
    get_policy_loss,
    value_loss,
)
from asyncrl.learners.presets import Preset

__all__ = ["DistReducer", "Reducer", "StepBatch", "StepLoss", "global_moments", "step_loss"]


class Reducer:
    """Sums and maxima over the learner ranks, in float64. This base class is a single rank."""

    def sum(self, values: list[float]) -> list[float]:
        return list(values)

    def max(self, values: list[float]) -> list[float]:
        return list(values)


class DistReducer(Reducer):
    """All-reduce over the default torch.distributed group (a collective: every rank must call it)."""

    def _reduce(self, values: list[float], op) -> list[float]:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor(values, dtype=torch.float64, device=device)  # NCCL reduces CUDA tensors, gloo CPU ones
        dist.all_reduce(t, op=op)
        return t.tolist()

    def sum(self, values: list[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)


def global_moments(reducer: Reducer) -> MomentsFn:
    """(mean, population std) over the response tokens of the whole step (every rank): two reductions."""

    def moments(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        on = mask > 0
        total, n = reducer.sum([float(torch.where(on, x, 0.0).sum()), float(on.sum())])
        mean = total / max(n, 1.0)
        (sq,) = reducer.sum([float(torch.where(on, (x - mean) ** 2, 0.0).sum())])
        return torch.tensor(mean, dtype=x.dtype), torch.tensor(sq / max(n, 1.0), dtype=x.dtype).sqrt()

    return moments


@dataclass
class StepBatch:
    """One rank's share of a step, aligned with ``loss.sequence_logprobs`` (position j predicts token j+1)."""

    rewards: Tensor  # (B,) R_i outcome reward, shaping (overlong penalty) included
    group_ids: Tensor  # (B,) int: samples of one prompt share an id
    mask: Tensor  # (B, T) 1.0 on response tokens
    behaviour_logprobs: Tensor  # (B, T) log mu(a_t | s_t) recorded by the generator


@dataclass
class StepLoss:
    policy_loss: Tensor  # () backpropagate through the policy engine
    value_loss: Tensor | None  # () backpropagate through the critic engine; None without a critic
    metrics: dict[str, float]  # learner/... over the whole step (every rank)


def step_loss(
    preset: Preset,
    batch: StepBatch,
    logprobs: Tensor,  # (B, T) log pi_theta, with gradient
    reducer: Reducer,
    ranks: int,  # data-parallel ranks that AVERAGE gradients (1 if the caller sums them)
    max_len: float,  # L_max of seq-mean-token-sum: the generation limit
    ref_logprobs: Tensor | None = None,  # (B, T) frozen reference model, when preset.uses_kl
    values: Tensor | None = None,  # (B, T) critic V(s_t), with gradient, when preset.needs_critic
) -> StepLoss:
    mask = batch.mask.to(logprobs.dtype)
    # 1. counts
    local = [float(mask.sum()), float(mask.shape[0])]
    n_tok, n_seq = reducer.sum(local)
    counts = LossCounts(n_tok, n_seq, max_len).scaled(ranks)
    # 2. KL folded into the reward
    kl_in = KLInput(logprobs, ref_logprobs, mask) if ref_logprobs is not None else None
    token_rewards = None
    if kl_in is not None and preset.kl_placement == "reward":
        token_rewards = kl_reward(kl_in, preset.kl_estimator, preset.kl_coef)
    # 3. advantages
    old_values = values.detach() if values is not None else None
    adv = get_advantage(preset.advantage)(
        AdvantageInput(batch.rewards, mask, batch.group_ids, token_rewards, old_values, global_moments(reducer)),
        preset.advantage_config,
    )
    # 4. off-policy correction. With one optimizer step per batch, the proximal policy of decoupled PPO
    # (the weights at the start of the step) IS the current policy before its update: its log-probs are
    # the detached log-probs of this very forward, no second forward pass needed.
    prox = logprobs.detach() if "prox_logprobs" in preset.required_inputs else None
    step_rewards = None  # per-token rewards for V-trace (only with a critic)
    if values is not None:
        step_rewards = token_level_rewards(batch.rewards.to(mask.dtype), mask, token_rewards)
    corr = get_correction(preset.correction)(
        CorrectionInput(logprobs.detach(), batch.behaviour_logprobs, mask, prox, step_rewards, old_values),
        preset.correction_config,
    )
    advantages = corr.advantages if corr.advantages is not None else adv.advantages
    returns = corr.value_targets if corr.value_targets is not None else adv.returns
    # 5. policy loss (+ KL loss)
    pol = get_policy_loss(preset.policy_loss)(
        PolicyLossInput(logprobs, corr.old_logprobs, advantages, mask, corr.weights), preset.loss_config
    )
    token_loss = pol.token_loss
    if kl_in is not None and preset.kl_placement == "loss":
        token_loss = token_loss + kl_loss(kl_in, preset.kl_estimator, preset.kl_coef, corr.weights)
    policy_loss = aggregate(preset.aggregation, token_loss, mask, counts)
    # 6. critic
    critic = None
    if values is not None:
        critic = value_loss(ValueLossInput(values, old_values, returns, mask), preset.value_clip)
        value = preset.value_coef * aggregate(preset.aggregation, critic.token_loss, mask, counts)
    # 7. metrics, weighted by this rank's tokens and summed over ranks
    n = local[0]
    sums = {
        f"{preset.correction}_clip_frac": corr.clip_frac * n,
        f"{preset.correction}_mean_ratio": corr.ratio_mean * n,
        "behaviour_kl": corr.behaviour_kl * n,
        "policy_clip_frac": pol.clip_frac * n,
        "policy_dual_clip_frac": pol.dual_clip_frac * n,
        "advantage_mean": float((advantages * mask).sum()),
    }
    if kl_in is not None:
        sums["kl_ref"] = float((kl_penalty(kl_in, preset.kl_estimator).detach() * mask).sum())
    if critic is not None:
        sums["value_error"] = critic.value_error * n
        sums["value_clip_frac"] = critic.clip_frac * n
    totals = reducer.sum([*sums.values(), float(policy_loss.detach())])
    metrics = {f"learner/{k}": v / max(n_tok, 1.0) for k, v in zip(sums, totals, strict=False)}
    metrics["learner/loss"] = totals[-1] / ranks  # each rank's loss is its share times the rank count
    (metrics[f"learner/{preset.correction}_max_ratio"],) = reducer.max([corr.ratio_max])
    if critic is not None:
        (metrics["learner/value_loss"],) = [v / ranks for v in reducer.sum([float(value.detach())])]
    return StepLoss(policy_loss, value if critic is not None else None, metrics)
