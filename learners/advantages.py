"""Advantage estimators as pure functions over typed inputs, chosen by name from ``ADVANTAGES``.

Notation (sequence i, response token t): R_i is the outcome reward of sequence i; ``token_rewards``
holds extra per-token rewards (e.g. a KL penalty folded in by ``kl.kl_reward``); the per-token reward
is r_{i,t} = token_rewards_{i,t} + R_i * [t is the LAST response token of i]; V_{i,t} is the critic's
value of the state before token t; a group g is the set of samples of one prompt (same ``group_ids``).

Invariants shared by every estimator:

* A sequence's steps are its response positions (``mask`` = 1) in order. Recursions skip padding, so
  a response may sit anywhere in its row; after the last response token the episode has ended
  (terminal: the value there is 0).
* Outputs are constants (computed under ``no_grad``) and are exactly 0 off the response, whatever
  junk the padded slots of the inputs hold.
* Every estimator computes in float64 and returns the input's dtype (``token_rewards``', else the
  rewards' as a float): group and batch statistics of float32 rewards are not rounded to float32.
* Group estimators (grpo, dr_grpo, rloo) score a sequence as S_i = R_i + sum_t token_rewards_{i,t}: a
  KL penalty in the reward is folded in at sequence level (RLOO's treatment) before the baseline.
* Group statistics use the POPULATION std (defined for a group of one), and groups may be ragged
  (a failed sample leaves its group smaller). A group whose scores are all equal gets A = 0 EXACTLY
  (``group_stats``: its mean is its score, not a rounded sum / n).
* Batch normalisation (REINFORCE++) is over every response token of the optimizer step. With several
  learner ranks, pass ``moments`` that all-reduces: the default only sees this rank's batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from asyncrl.config.pieces import AdvantageConfig, lookup

__all__ = [
    "ADVANTAGES",
    "AdvantageConfig",
    "AdvantageFn",
    "AdvantageInput",
    "AdvantageOutput",
    "MomentsFn",
    "discounted_returns",
    "dr_grpo",
    "gae",
    "get_advantage",
    "group_stats",
    "grpo",
    "masked_moments",
    "overlong_penalty",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
    "token_level_rewards",
]

MomentsFn = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


# ----------------------------------------------------------------------------- typed inputs/outputs


@dataclass
class AdvantageInput:
    """One optimizer step's sequences (or one rank's share, whole groups only)."""

    rewards: Tensor  # (B,) R_i: outcome reward of each sequence (verifier / reward model score)
    mask: Tensor  # (B, T) 1.0 on response tokens, 0.0 on prompt / padding
    group_ids: Tensor | None = None  # (B,) int: samples of one prompt share an id (group estimators)
    token_rewards: Tensor | None = None  # (B, T) extra per-token reward, e.g. kl.kl_reward(...)
    values: Tensor | None = None  # (B, T) V(s_{i,t}) from the critic (gae only)
    moments: MomentsFn | None = None  # (x, mask) -> (mean, std) over the GLOBAL step; None: this batch
    turn_rewards: Tensor | None = None  # (B, T) each turn's reward at its last token; part of R_i, not extra

    def __post_init__(self) -> None:
        shape = tuple(self.mask.shape)
        if len(shape) != 2:
            raise ValueError(f"mask must be (B, T), got {shape}")
        if tuple(self.rewards.shape) != shape[:1]:
            raise ValueError(f"rewards must be (B,) = {shape[:1]}, got {tuple(self.rewards.shape)}")
        if self.group_ids is not None and tuple(self.group_ids.shape) != shape[:1]:
            raise ValueError(f"group_ids must be (B,) = {shape[:1]}, got {tuple(self.group_ids.shape)}")
        for name in ("token_rewards", "turn_rewards", "values"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape} like mask")


@dataclass
class AdvantageOutput:
    advantages: Tensor  # (B, T) A_{i,t}, detached, 0 off the response
    returns: Tensor | None  # (B, T) gae: critic targets A + V; reinforce_pp*: return-to-go; else None


# ----------------------------------------------------------------------------- helpers


def token_level_rewards(
    rewards: Tensor, mask: Tensor, token_rewards: Tensor | None = None, turn_rewards: Tensor | None = None
) -> Tensor:
    """r_{i,t} = token_rewards_{i,t} + turn_rewards_{i,t} + (R_i - sum_t turn_rewards_{i,t}) on the last
    response token of i. (B,), (B, T) -> (B, T).

    ``turn_rewards`` places the part of R_i each turn of a multi-turn episode earned at that turn's last
    token (token-level estimators then credit each turn with its own reward); what they do not cover
    (all of R_i without them) lands on the last token. Either way sum_t r_{i,t} = R_i + sum_t
    token_rewards_{i,t}. A row without response tokens receives no reward (it has no step to carry it).
    """
    on = mask > 0
    pos = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(on, pos, -1).max(dim=1).values  # (B,) index of the last response token, -1 if none
    outcome = rewards.to(torch.result_type(rewards, 1.0))
    turns = torch.zeros_like(mask, dtype=outcome.dtype) if turn_rewards is None else torch.where(on, turn_rewards, 0.0)
    out = torch.where(pos == last[:, None], (outcome - turns.sum(dim=1))[:, None], 0.0) + turns
    if token_rewards is not None:
        out = out + torch.where(on, token_rewards, 0.0)
    return torch.where(on, out, 0.0)


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_{i,t} = sum_{k >= 0} gamma^k r_{i,t+k} over the response steps of i. (B, T) -> (B, T)."""
    on = mask > 0
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        step = token_rewards[:, t] + gamma * running
        running = torch.where(on[:, t], step, running)
        out[:, t] = torch.where(on[:, t], step, 0.0)
    return out


def overlong_penalty(lengths: Tensor, max_len: int, buffer: float, penalty: float) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), added to the outcome reward. (B,) -> (B,).

    With L_cache = buffer * max_len: 0 for |y| <= max_len - L_cache, then linear down to -penalty at
    |y| = max_len (the generation limit: a truncated response gets the full penalty). buffer = 0: off.
    """
    cache = buffer * max_len
    if cache <= 0:
        return torch.zeros_like(lengths, dtype=torch.float64)
    over = (lengths.to(torch.float64) - (max_len - cache)).clamp(min=0.0, max=cache)
    return -penalty * over / cache


def masked_moments(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(mean, population std) of x over response tokens; (0, 0) when there are none."""
    on = mask > 0
    n = on.sum().clamp(min=1)
    mean = torch.where(on, x, 0.0).sum() / n
    var = torch.where(on, (x - mean) ** 2, 0.0).sum() / n
    return mean, var.sqrt()


def group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Each sequence's group (mean, population std, size), for ragged groups. (B,), (B,) -> 3 x (B,) float64.

    A group whose scores are all equal has mean = that score and std = 0 exactly, so its members'
    deviations R_i - mean_g are exactly 0 (a rounded sum / n need not give the score back).
    """
    scores = scores.to(torch.float64)
    _, inv = torch.unique(group_ids, return_inverse=True)
    zeros = scores.new_zeros(int(inv.max()) + 1 if inv.numel() else 0)
    size = zeros.index_add(0, inv, torch.ones_like(scores))
    mean = zeros.index_add(0, inv, scores) / size
    hi = zeros.scatter_reduce(0, inv, scores, "amax", include_self=False)
    lo = zeros.scatter_reduce(0, inv, scores, "amin", include_self=False)
    mean = torch.where(hi == lo, hi, mean)
    var = zeros.index_add(0, inv, (scores - mean[inv]) ** 2) / size
    return mean[inv], var.sqrt()[inv], size[inv]


def _in_float64(estimator):
    """Run ``estimator`` on float64 inputs; its outputs come back in the input's dtype."""

    @functools.wraps(estimator)
    def run(inp: AdvantageInput, cfg: AdvantageConfig) -> AdvantageOutput:
        dtype = inp.token_rewards.dtype if inp.token_rewards is not None else torch.result_type(inp.rewards, 1.0)
        wide = {k: getattr(inp, k) for k in ("rewards", "token_rewards", "turn_rewards", "values")}
        out = estimator(replace(inp, **{k: v if v is None else v.to(torch.float64) for k, v in wide.items()}), cfg)
        return AdvantageOutput(out.advantages.to(dtype), None if out.returns is None else out.returns.to(dtype))

    return run


def _sequence_scores(inp: AdvantageInput) -> tuple[Tensor, Tensor]:
    """(score_i = R_i + sum_t token_rewards_{i,t}, group_ids): a sequence-level KL folds in here."""
    if inp.group_ids is None:
        raise ValueError("group estimators need group_ids (B,): which prompt each sample answers")
    scores = inp.rewards
    if inp.token_rewards is not None:
        scores = scores + torch.where(inp.mask > 0, inp.token_rewards, 0.0).sum(dim=1)
    return scores, inp.group_ids


def _broadcast(seq_adv: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask > 0, seq_adv[:, None], 0.0)


def _whiten(x: Tensor, inp: AdvantageInput, eps: float) -> Tensor:
    mean, std = (inp.moments or masked_moments)(x, inp.mask)
    return torch.where(inp.mask > 0, (x - mean) / (std + eps), 0.0)


# ----------------------------------------------------------------------------- estimators


@torch.no_grad()
@_in_float64
def gae(inp: AdvantageInput, cfg: AdvantageConfig) -> AdvantageOutput:
    """GAE (Schulman et al. 2016) with a learned critic, as in PPO.

    delta_t = r_t + gamma V_{t+1} - V_t (V after the last response token = 0),
    A_t = sum_{l >= 0} (gamma lambda)^l delta_{t+l},  returns_t = A_t + V_t (the critic's target).
    """
    if inp.values is None:
        raise ValueError("gae needs values (B, T) from the critic")
    r = token_level_rewards(inp.rewards, inp.mask, inp.token_rewards, inp.turn_rewards)
    values = inp.values
    on = inp.mask > 0
    adv = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    next_value = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + cfg.gamma * next_value - values[:, t]
        step = delta + cfg.gamma * cfg.lam * running
        running = torch.where(on[:, t], step, running)
        next_value = torch.where(on[:, t], values[:, t], next_value)
        adv[:, t] = torch.where(on[:, t], step, 0.0)
    return AdvantageOutput(advantages=adv, returns=torch.where(on, adv + values, 0.0))


@torch.no_grad()
@_in_float64
def grpo(inp: AdvantageInput, cfg: AdvantageConfig) -> AdvantageOutput:
    """GRPO (Shao et al. 2024): A_i = (R_i - mean_g R) / (std_g R + eps), on every token of i."""
    scores, groups = _sequence_scores(inp)
    mean, std, _ = group_stats(scores, groups)
    return AdvantageOutput(advantages=_broadcast((scores - mean) / (std + cfg.eps), inp.mask), returns=None)


@torch.no_grad()
@_in_float64
def dr_grpo(inp: AdvantageInput, cfg: AdvantageConfig) -> AdvantageOutput:
    """Dr.GRPO (Liu et al. 2025): A_i = R_i - mean_g R. No std division (it up-weights easy/hard groups)."""
    scores, groups = _sequence_scores(inp)
    mean, _, _ = group_stats(scores, groups)
    return AdvantageOutput(advantages=_broadcast(scores - mean, inp.mask), returns=None)


@torch.no_grad()
@_in_float64
def rloo(inp: AdvantageInput, cfg: AdvantageConfig) -> AdvantageOutput:
    """RLOO (Ahmadian et al. 2024): A_i = R_i - (1/(n-1)) sum_{j != i} R_j over the n samples of i's group.

    Computed as n/(n-1) (R_i - mean_g R) (the same, and exactly 0 for a flat group). A group of one has
    no leave-one-out baseline: A = 0.
    """
    scores, groups = _sequence_scores(inp)
    mean, _, size = group_stats(scores, groups)
    adv = size / (size - 1).clamp(min=1) * (scores - mean)
    return AdvantageOutput(advantages=_broadcast(torch.where(size > 1, adv, 0.0), inp.mask), returns=None)


@torch.no_grad()
@_in_float64
def reinforce_pp(inp: AdvantageInput, cfg: AdvantageConfig) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025): G_t = sum_k gamma^k r_{t+k} with any KL penalty folded into r;
    A_t = (G_t - mean_batch G) / (std_batch G + eps) over every response token of the step."""
    r = token_level_rewards(inp.rewards, inp.mask, inp.token_rewards, inp.turn_rewards)
    returns = discounted_returns(r, inp.mask, cfg.gamma)
    return AdvantageOutput(advantages=_whiten(returns, inp, cfg.eps), returns=returns)


@torch.no_grad()
@_in_float64
def reinforce_pp_baseline(inp: AdvantageInput, cfg: AdvantageConfig) -> AdvantageOutput:
    """REINFORCE++-baseline: R'_i = R_i - mean_g R (group-mean baseline), then REINFORCE++ on R':
    G'_t = sum_k gamma^k r'_{t+k},  A_t = (G'_t - mean_batch G') / (std_batch G' + eps)."""
    if inp.group_ids is None:
        raise ValueError("reinforce_pp_baseline needs group_ids (B,): which prompt each sample answers")
    centred = inp.rewards - group_stats(inp.rewards, inp.group_ids)[0]
    r = token_level_rewards(centred, inp.mask, inp.token_rewards, inp.turn_rewards)
    returns = discounted_returns(r, inp.mask, cfg.gamma)
    return AdvantageOutput(advantages=_whiten(returns, inp, cfg.eps), returns=returns)


# ----------------------------------------------------------------------------- registry

AdvantageFn = Callable[[AdvantageInput, AdvantageConfig], AdvantageOutput]

ADVANTAGES: dict[str, AdvantageFn] = {
    "gae": gae,
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
}


def get_advantage(name: str) -> AdvantageFn:
    """The estimator registered under ``name`` (``ADVANTAGES``); UserError listing known names if none."""
    return lookup(ADVANTAGES, "advantage estimator", name)
