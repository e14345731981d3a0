"""Off-policy corrections for stale / mismatched behaviour log-probs, as pure functions.

Generators record log mu(a_t | s_t), the behaviour policy that actually sampled each token (weights
``k`` versions stale, and another numerical stack: vLLM vs the training kernels). A correction
compares mu with a TARGET policy and returns, per token:

* ``weights`` w_{i,t}: DETACHED multipliers of the policy loss (``PolicyLossInput.weights``): an
  importance weight, 0 for a rejected token or sequence, and 0 off the response;
* ``old_logprobs``: the anchor of a PPO-style ratio (``PolicyLossInput.old_logprobs``).

Target and anchor. Without ``prox_logprobs`` the target is the learner's current pi_theta (its value
only) and the anchor is mu: rho_t = pi_t / mu_t. That is the importance weight of an unclipped policy
gradient (``policy_gradient``: w(pi / mu) A grad log pi), and, with ``none``, plain PPO on behaviour data.
With ``prox_logprobs`` (the proximal policy pi_prox, log-probs at the START of the optimizer step) the
target and the anchor are pi_prox: w corrects pi_prox against mu and the loss clips r = pi / pi_prox,

    l_t = -w_t(pi_prox / mu) * min(r_t A_t, clip(r_t) A_t)

(Truncated IS and IcePop with pi_old = pi_prox; decoupled PPO, Hilton et al. 2022). A ratio loss
(``ppo_clip``, ``gspo``) under any correction but ``none`` always gets pi_prox
(``presets.Preset.required_inputs``): weighting by pi / mu AND clipping pi / mu would apply the weight
twice. When a batch gets a single optimizer step, pi_prox = sg(pi_theta) exactly: the learner passes
``logprobs.detach()`` instead of a second forward pass (r = 1, the loss is -w A grad log pi).

Metrics, over this batch's response tokens: ``clip_frac`` (tokens whose weight was truncated or that
were rejected; for sequence-level corrections, the tokens of affected sequences), ``ratio_mean`` /
``ratio_max`` (the raw ratio the correction tests: per token, or per sequence for ``seq_tis`` /
``geo_mask``), ``behaviour_kl`` (k3 estimate of KL(mu || target): mean (rho - 1) - log rho).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl.config.pieces import CorrectionConfig, lookup
from asyncrl.learners.batching import masked_mean

__all__ = [
    "CORRECTIONS",
    "CorrectionConfig",
    "CorrectionFn",
    "CorrectionInput",
    "CorrectionOutput",
    "decoupled_ppo",
    "geo_mask",
    "get_correction",
    "icepop",
    "no_correction",
    "seq_tis",
    "tis",
    "vtrace",
]

# A sequence ratio prod_t rho_t overflows float32 past e^88; its metric is reported with the log
# clamped here (e^50 ~ 5e21: finite in JSON and float32, far above any sensible cap).
_METRIC_LOG_CLAMP = 50.0


@dataclass
class CorrectionInput:
    logprobs: Tensor  # (B, T) log pi_theta(a_t | s_t), the learner's current policy (value only)
    behaviour_logprobs: Tensor  # (B, T) log mu(a_t | s_t) recorded by the generator
    mask: Tensor  # (B, T) 1.0 on response tokens, 0.0 on prompt / padding
    prox_logprobs: Tensor | None = None  # (B, T) log pi_prox at step start; target AND anchor when given
    rewards: Tensor | None = None  # (B, T) r_t per-token rewards (vtrace; advantages.token_level_rewards)
    values: Tensor | None = None  # (B, T) V(x_t) from the critic (vtrace)
    bootstrap_value: Tensor | None = None  # (B,) V after the last response token (vtrace); None = 0 (terminal)

    def __post_init__(self) -> None:
        shape = tuple(self.logprobs.shape)
        if len(shape) != 2:
            raise ValueError(f"logprobs must be (B, T), got {shape}")
        for name in ("behaviour_logprobs", "mask", "prox_logprobs", "rewards", "values"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape} like logprobs")
        if self.bootstrap_value is not None and tuple(self.bootstrap_value.shape) != shape[:1]:
            raise ValueError(f"bootstrap_value must be (B,), got {tuple(self.bootstrap_value.shape)}")


@dataclass
class CorrectionOutput:
    weights: Tensor  # (B, T) detached w_{i,t}; 0 off the response and on rejected tokens
    old_logprobs: Tensor  # (B, T) the PPO ratio's anchor: mu, or pi_prox when given
    clip_frac: float  # fraction of response tokens truncated or rejected
    ratio_mean: float  # mean raw ratio (per token, or per sequence for sequence-level corrections)
    ratio_max: float  # max raw ratio
    behaviour_kl: float  # k3 estimate of KL(mu || target)
    advantages: Tensor | None = None  # (B, T) vtrace: r_s + gamma v_{s+1} - V(x_s); times weights = IMPALA's
    value_targets: Tensor | None = None  # (B, T) vtrace: v_s, the critic's targets


# ----------------------------------------------------------------------------- helpers


def _log_rho(inp: CorrectionInput) -> tuple[Tensor, Tensor, Tensor]:
    """(on, log rho = log target - log mu with padding forced to 0, anchor log-probs)."""
    on = inp.mask > 0
    target = (inp.prox_logprobs if inp.prox_logprobs is not None else inp.logprobs).detach()
    mu = torch.where(on, inp.behaviour_logprobs.to(target.dtype), 0.0)
    log_rho = torch.where(on, torch.where(on, target, 0.0) - mu, 0.0)
    anchor = mu if inp.prox_logprobs is None else torch.where(on, target, 0.0)
    return on, log_rho, anchor


def _output(
    inp: CorrectionInput,
    weights: Tensor,  # (B, T)
    affected: Tensor,  # (B, T) bool: truncated or rejected
    ratio: Tensor,  # (B, T) per token, or (B,) per sequence: the raw ratio the correction tests
    ratio_valid: Tensor,  # bool, shaped like ratio: which entries are real (response tokens / non-empty rows)
    log_rho: Tensor,  # (B, T)
    anchor: Tensor,  # (B, T)
    **extra: Tensor,
) -> CorrectionOutput:
    mask = inp.mask.to(log_rho.dtype)
    n = float(mask.sum())
    valid = ratio[ratio_valid]
    return CorrectionOutput(
        weights=torch.where(mask > 0, weights, 0.0),
        old_logprobs=anchor,
        clip_frac=masked_mean(affected.to(mask.dtype), mask, n),
        ratio_mean=float(valid.mean()) if valid.numel() else 0.0,
        ratio_max=float(valid.max()) if valid.numel() else 0.0,
        behaviour_kl=masked_mean(torch.expm1(log_rho) - log_rho, mask, n),
        **extra,
    )


def _sequence_log_ratio(log_rho: Tensor, on: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(sum_t log rho_t, |y_i|, has_tokens) per sequence: three (B,)."""
    lengths = on.sum(dim=1)
    return log_rho.sum(dim=1), lengths, lengths > 0


# ----------------------------------------------------------------------------- corrections


@torch.no_grad()
def no_correction(inp: CorrectionInput, cfg: CorrectionConfig) -> CorrectionOutput:
    """w = 1 on the response; the anchor is mu (plain PPO on behaviour data; metrics still reported)."""
    on, log_rho, anchor = _log_rho(inp)
    return _output(inp, on.to(log_rho.dtype), torch.zeros_like(on), torch.exp(log_rho), on, log_rho, anchor)


@torch.no_grad()
def tis(inp: CorrectionInput, cfg: CorrectionConfig) -> CorrectionOutput:
    """Token truncated IS: w_t = min(rho_t, C), rho_t = target_t / mu_t."""
    on, log_rho, anchor = _log_rho(inp)
    rho = torch.exp(log_rho)
    return _output(inp, rho.clamp(max=cfg.tis_cap), rho > cfg.tis_cap, rho, on, log_rho, anchor)


@torch.no_grad()
def decoupled_ppo(inp: CorrectionInput, cfg: CorrectionConfig) -> CorrectionOutput:
    """Decoupled PPO (Hilton et al. 2022): anchor pi_prox, w_t = min(pi_prox,t / mu_t, C).

    With the loss clipping r = pi / pi_prox: l_t = w_t * max(-r A, -clip(r) A). Needs ``prox_logprobs``.
    """
    if inp.prox_logprobs is None:
        raise ValueError("decoupled_ppo needs prox_logprobs: log pi_prox recomputed at step start")
    return tis(inp, cfg)


@torch.no_grad()
def seq_tis(inp: CorrectionInput, cfg: CorrectionConfig) -> CorrectionOutput:
    """Sequence truncated IS: w_{i,t} = min(prod_t rho_{i,t}, C) on every token of sequence i (log space)."""
    on, log_rho, anchor = _log_rho(inp)
    seq_log, _, has = _sequence_log_ratio(log_rho, on)
    cap = math.log(cfg.seq_tis_cap)
    weights = torch.exp(seq_log.clamp(max=cap))[:, None].expand_as(log_rho)
    affected = (seq_log > cap)[:, None] & on
    ratio = torch.exp(seq_log.clamp(-_METRIC_LOG_CLAMP, _METRIC_LOG_CLAMP))
    return _output(inp, weights, affected, ratio, has, log_rho, anchor)


@torch.no_grad()
def icepop(inp: CorrectionInput, cfg: CorrectionConfig) -> CorrectionOutput:
    """IcePop (Ling team 2025): w_t = rho_t if low <= rho_t <= high, else 0 (masked, no truncation)."""
    on, log_rho, anchor = _log_rho(inp)
    rho = torch.exp(log_rho)
    keep = (rho >= cfg.icepop_low) & (rho <= cfg.icepop_high)
    return _output(inp, torch.where(keep, rho, 0.0), ~keep, rho, on, log_rho, anchor)


@torch.no_grad()
def geo_mask(inp: CorrectionInput, cfg: CorrectionConfig) -> CorrectionOutput:
    """Geometric-mean sequence masking: g_i = exp((1/|y_i|) sum_t log rho_{i,t}); w_{i,t} = 1 if
    low <= g_i <= high, else 0 for every token of i (a rejection, not a reweighting)."""
    on, log_rho, anchor = _log_rho(inp)
    seq_log, lengths, has = _sequence_log_ratio(log_rho, on)
    geo = torch.exp(seq_log / lengths.clamp(min=1))
    keep = ((geo >= cfg.geo_low) & (geo <= cfg.geo_high))[:, None]
    return _output(inp, keep.to(log_rho.dtype).expand_as(log_rho), ~keep & on, geo, has, log_rho, anchor)


@torch.no_grad()
def vtrace(inp: CorrectionInput, cfg: CorrectionConfig) -> CorrectionOutput:
    """V-trace (Espeholt et al. 2018) over each sequence's response steps s (padding skipped).

    rho_s = min(rho_bar, pi_s / mu_s), c_s = min(c_bar, pi_s / mu_s), delta_s = rho_s (r_s + gamma V_{s+1} - V_s),
    v_s = V_s + sum_{t >= s} gamma^{t-s} (prod_{k=s}^{t-1} c_k) delta_t   (V after the last step = bootstrap),
    policy-gradient advantage rho_s (r_s + gamma v_{s+1} - V_s) = weights * advantages (v after the last = bootstrap).
    """
    if inp.rewards is None or inp.values is None:
        raise ValueError("vtrace needs rewards (B, T) and values (B, T)")
    on, log_rho, anchor = _log_rho(inp)
    rho = torch.exp(log_rho)
    rho_clip, c = rho.clamp(max=cfg.rho_bar), rho.clamp(max=cfg.c_bar)
    rewards = torch.where(on, inp.rewards.to(rho.dtype), 0.0)
    values = torch.where(on, inp.values.to(rho.dtype), 0.0)
    boot = torch.zeros_like(rho[:, 0]) if inp.bootstrap_value is None else inp.bootstrap_value.to(rho.dtype)
    vs, adv = torch.zeros_like(rho), torch.zeros_like(rho)
    next_value, next_vs, acc = boot, boot, torch.zeros_like(boot)  # V_{s+1}, v_{s+1}, v_{s+1} - V_{s+1}
    for s in reversed(range(rho.shape[1])):
        m = on[:, s]
        delta = rho_clip[:, s] * (rewards[:, s] + cfg.gamma * next_value - values[:, s])
        step = delta + cfg.gamma * c[:, s] * acc
        adv[:, s] = torch.where(m, rewards[:, s] + cfg.gamma * next_vs - values[:, s], 0.0)
        vs[:, s] = torch.where(m, values[:, s] + step, 0.0)
        acc = torch.where(m, step, acc)
        next_value = torch.where(m, values[:, s], next_value)
        next_vs = torch.where(m, vs[:, s], next_vs)
    return _output(inp, rho_clip, rho > cfg.rho_bar, rho, on, log_rho, anchor, advantages=adv, value_targets=vs)


# ----------------------------------------------------------------------------- registry

CorrectionFn = Callable[[CorrectionInput, CorrectionConfig], CorrectionOutput]

CORRECTIONS: dict[str, CorrectionFn] = {
    "none": no_correction,
    "tis": tis,
    "seq_tis": seq_tis,
    "icepop": icepop,
    "geo_mask": geo_mask,
    "decoupled_ppo": decoupled_ppo,
    "vtrace": vtrace,
}


def get_correction(name: str) -> CorrectionFn:
    """The correction registered under ``name`` (``CORRECTIONS``); UserError listing known names if none."""
    return lookup(CORRECTIONS, "correction", name)
