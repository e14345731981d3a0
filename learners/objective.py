"""How one learner step composes a preset's pieces into the losses to backpropagate (pure torch).

A batch (one policy version) is trained in ``learner.minibatches`` x ``learner.epochs`` optimizer steps.
What needs the whole batch is computed ONCE by ``prepare_batch``, at pi_prox and V_old (the policy and
critic at batch start); ``minibatch_loss`` then gives each optimizer step's losses. For one rank's
share (whole groups: group statistics never cross ranks), in order:

  prepare_batch (whole batch, once)
  2. KL reward   kl_placement = reward: token_rewards = -beta k(pi_prox, pi_ref), detached
  3. advantages  the preset's estimator, in float64 (GAE on V_old); batch moments (REINFORCE++)
                 all-reduced over ranks
  minibatch_loss (each optimizer step's rows)
  1. counts      N_tok, N_seq of THESE rows summed over ranks -> ``LossCounts`` divided by the rank
                 count, because DeepSpeed AVERAGES gradients over ranks: the applied gradient is the
                 mini-batch's over all ranks
  4. correction  weights w and the ratio's anchor from mu (behaviour), pi and pi_prox: a ratio loss
                 under a correction gets w(pi_prox / mu) and the anchor pi_prox (``required_inputs``),
                 so the weight is applied once; V-trace's own advantages and value targets replace
                 those of step 3 when it supplies them
  5. policy loss + KL loss (kl_placement = loss, weighted by w), aggregated by the preset's rule
  6. value loss  the critic's (value clipping around V_old), same aggregation
  7. metrics     token-weighted sums (and maxima) over ranks: the numbers describe the whole step

``step_loss`` is both for one optimizer step per batch: pi_prox and V_old are then the detached outputs
of the same forward. Every normaliser is global, so the loss and gradient of a step do not depend on how
its groups are split across ranks (tests/learners/test_loss_split.py checks 1 rank vs 2 gloo ranks to 1e-6;
tests/learners/test_minibatches.py the same with mini-batches).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.config.presets import Preset
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

__all__ = [
    "BatchInputs",
    "DistReducer",
    "Reducer",
    "StepBatch",
    "StepLoss",
    "global_moments",
    "mean_metrics",
    "minibatch_loss",
    "minibatch_rows",
    "prepare_batch",
    "step_loss",
    "take_rows",
]


class Reducer:
    """Sums and maxima over the learner ranks, in float64. This base class is a single rank."""

    def sum(self, values: list[float]) -> list[float]:
        return list(values)

    def max(self, values: list[float]) -> list[float]:
        return list(values)

    def sum_dict(self, values: dict[str, float]) -> dict[str, float]:
        """The sum over ranks of each named value (one reduction; every rank passes the same names)."""
        return dict(zip(values, self.sum(list(values.values())), strict=True))


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
    turn_rewards: Tensor | None = None  # (B, T) multi-turn episodes: each turn's share of R_i at its last token


@dataclass
class StepLoss:
    policy_loss: Tensor  # () backpropagate through the policy engine
    value_loss: Tensor | None  # () backpropagate through the critic engine; None without a critic
    metrics: dict[str, float]  # learner/... over the whole step (every rank)


@dataclass
class BatchInputs:
    """What needs the whole batch, computed ONCE before its optimizer steps (this rank's rows, whole
    groups): group statistics, batch moments and GAE never see a mini-batch alone."""

    advantages: Tensor  # (B, T) A_t of the preset's estimator (V-trace may replace them per mini-batch)
    returns: Tensor | None  # (B, T) critic targets of the estimator; None without a critic
    token_rewards: Tensor | None  # (B, T) -beta k(pi_prox, pi_ref) when kl_placement = reward, detached
    prox_logprobs: Tensor | None  # (B, T) log pi_prox (the policy at batch start), when the correction needs it
    ref_logprobs: Tensor | None  # (B, T) frozen reference model, when preset.uses_kl
    old_values: Tensor | None  # (B, T) V_old: the critic at batch start (GAE, value clipping, V-trace)


def take_rows(obj, rows: Tensor):
    """A StepBatch / BatchInputs restricted to ``rows`` (every tensor field indexed on dim 0)."""
    return replace(obj, **{f.name: _rows(getattr(obj, f.name), rows) for f in fields(obj)})


def _rows(x, rows: Tensor):
    return x[rows] if isinstance(x, Tensor) else x


def minibatch_rows(group_ids: Tensor, minibatches: int) -> list[Tensor]:
    """Row indices of each mini-batch: the rank's groups (ids 0..G-1) cut into ``minibatches`` runs of
    consecutive groups. Always exactly ``minibatches`` entries, so every rank steps in lockstep."""
    n_groups = int(group_ids.max()) + 1
    chunks = torch.arange(n_groups, device=group_ids.device).tensor_split(minibatches)
    return [torch.nonzero(torch.isin(group_ids, c)).squeeze(-1) for c in chunks]


def prepare_batch(
    preset: Preset,
    batch: StepBatch,
    prox_logprobs: Tensor,  # (B, T) log pi_prox = the policy at batch start, detached
    reducer: Reducer,
    ref_logprobs: Tensor | None = None,  # (B, T) frozen reference model, when preset.uses_kl
    old_values: Tensor | None = None,  # (B, T) V_old = the critic at batch start, detached
) -> BatchInputs:
    """Steps 2-3 on the whole batch: the KL reward (at pi_prox) and the preset's advantages (batch moments
    all-reduced over ranks)."""
    mask = batch.mask.to(prox_logprobs.dtype)
    kl_in = KLInput(prox_logprobs, ref_logprobs, mask) if ref_logprobs is not None else None
    token_rewards = None
    if kl_in is not None and preset.kl_placement == "reward":
        token_rewards = kl_reward(kl_in, preset.kl_estimator, preset.kl_coef)
    adv = get_advantage(preset.advantage)(
        AdvantageInput(
            batch.rewards, mask, batch.group_ids, token_rewards, old_values, global_moments(reducer), batch.turn_rewards
        ),
        preset.advantage_config,
    )
    prox = prox_logprobs if "prox_logprobs" in preset.required_inputs else None
    return BatchInputs(adv.advantages, adv.returns, token_rewards, prox, ref_logprobs, old_values)


def minibatch_loss(
    preset: Preset,
    batch: StepBatch,
    inputs: BatchInputs,  # prepare_batch's, restricted to the same rows as ``batch``
    logprobs: Tensor,  # (B, T) log pi_theta, with gradient
    reducer: Reducer,
    ranks: int,  # data-parallel ranks that AVERAGE gradients (1 if the caller sums them)
    max_len: float,  # L_max of seq-mean-token-sum: the generation limit
    values: Tensor | None = None,  # (B, T) critic V(s_t), with gradient, when preset.needs_critic
) -> StepLoss:
    """Steps 1 and 4-7 for one optimizer step's rows (counts all-reduced for exactly these rows)."""
    mask = batch.mask.to(logprobs.dtype)
    # 1. counts
    local = [float(mask.sum()), float(mask.shape[0])]
    n_tok, n_seq = reducer.sum(local)
    counts = LossCounts(n_tok, n_seq, max_len).scaled(ranks)
    kl_in = KLInput(logprobs, inputs.ref_logprobs, mask) if inputs.ref_logprobs is not None else None
    old_values = inputs.old_values
    # 4. off-policy correction: pi (now) against pi_prox (batch start) and mu (behaviour)
    step_rewards = None  # per-token rewards for V-trace (only with a critic)
    if values is not None:
        step_rewards = token_level_rewards(batch.rewards.to(mask.dtype), mask, inputs.token_rewards, batch.turn_rewards)
    corr = get_correction(preset.correction)(
        CorrectionInput(
            logprobs.detach(), batch.behaviour_logprobs, mask, inputs.prox_logprobs, step_rewards, old_values
        ),
        preset.correction_config,
    )
    advantages = corr.advantages if corr.advantages is not None else inputs.advantages
    returns = corr.value_targets if corr.value_targets is not None else inputs.returns
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
    """One optimizer step on the whole batch. Its proximal policy (the weights at the start of the step)
    IS the current policy before its update: pi_prox and V_old are the detached outputs of this very
    forward, no second forward pass needed (the clip and the value clip then never bind)."""
    old_values = values.detach() if values is not None else None
    inputs = prepare_batch(preset, batch, logprobs.detach(), reducer, ref_logprobs, old_values)
    return minibatch_loss(preset, batch, inputs, logprobs, reducer, ranks, max_len, values)


def mean_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """Several optimizer steps' metrics as one record: the mean of each, the maximum of the maxima."""
    out = {}
    for key in steps[0]:
        column = [m[key] for m in steps]
        out[key] = max(column) if key.endswith("_max_ratio") else sum(column) / len(column)
    return out
