"""KL(pi_theta || pi_ref) estimators (Schulman, "Approximating KL divergence", 2020), as pure functions.

Tokens are sampled from q = pi_theta and scored against p = pi_ref; per token, with
log r = log pi_ref - log pi_theta:

* ``k1`` = -log r                     unbiased, high variance, can be negative;
* ``k2`` = (log r)^2 / 2              biased (exact to second order), low variance, >= 0;
* ``k3`` = (r - 1) - log r            unbiased, low variance, >= 0.

Two placements, each scaled by a coefficient beta:

* in the reward (``kl_reward``): r_t -= beta * k_t, DETACHED, fed to an advantage estimator as
  ``AdvantageInput.token_rewards`` (PPO, REINFORCE++, RLOO);
* as a loss term (``kl_loss``): l_t = beta * k_t with gradient, aggregated like a policy loss
  (GRPO). grad k1 = grad log pi; grad k2 = (log pi - log pi_ref) grad log pi; grad k3 = (1 - r) grad log pi.

Invariant: E_{a ~ pi}[k1] = E_{a ~ pi}[k3] = KL(pi || pi_ref) exactly. Off-policy (tokens from mu, not pi)
the estimates are biased unless reweighted; the loss term accepts the correction's weights for that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl.config.pieces import lookup

__all__ = [
    "KL_ESTIMATORS",
    "KLEstimatorFn",
    "KLInput",
    "get_kl_estimator",
    "k1",
    "k2",
    "k3",
    "kl_loss",
    "kl_penalty",
    "kl_reward",
]


@dataclass
class KLInput:
    logprobs: Tensor  # (B, T) log pi_theta(a_t | s_t); carries gradient when used as a loss
    ref_logprobs: Tensor  # (B, T) log pi_ref(a_t | s_t) from the frozen reference model
    mask: Tensor  # (B, T) 1.0 on response tokens, 0.0 on prompt / padding

    def __post_init__(self) -> None:
        shape = tuple(self.logprobs.shape)
        for name in ("ref_logprobs", "mask"):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected {shape}")


def k1(log_r: Tensor) -> Tensor:
    """-log r = log pi_theta - log pi_ref."""
    return -log_r


def k2(log_r: Tensor) -> Tensor:
    """(log r)^2 / 2."""
    return 0.5 * log_r**2


def k3(log_r: Tensor) -> Tensor:
    """(r - 1) - log r, r = pi_ref / pi_theta (expm1 keeps it accurate and >= 0 near r = 1)."""
    return torch.expm1(log_r) - log_r


KLEstimatorFn = Callable[[Tensor], Tensor]
KL_ESTIMATORS: dict[str, KLEstimatorFn] = {"k1": k1, "k2": k2, "k3": k3}


def get_kl_estimator(name: str) -> KLEstimatorFn:
    """The estimator registered under ``name`` (``KL_ESTIMATORS``); UserError listing known names if none."""
    return lookup(KL_ESTIMATORS, "KL estimator", name)


def kl_penalty(inp: KLInput, estimator: str) -> Tensor:
    """Per-token estimate k_t of KL(pi_theta || pi_ref), with gradient, 0 off the response. (B, T)."""
    on = inp.mask > 0
    lp = inp.logprobs
    log_r = torch.where(on, inp.ref_logprobs.to(lp.dtype) - lp, 0.0)
    return torch.where(on, get_kl_estimator(estimator)(log_r), 0.0)


def kl_reward(inp: KLInput, estimator: str, coef: float) -> Tensor:
    """-beta * k_t, detached: the per-token reward penalty for ``AdvantageInput.token_rewards``. (B, T)."""
    with torch.no_grad():
        return -coef * kl_penalty(inp, estimator)


def kl_loss(inp: KLInput, estimator: str, coef: float, weights: Tensor | None = None) -> Tensor:
    """beta * w_t * k_t with gradient: a per-token loss to aggregate like a policy loss. (B, T).

    ``weights`` (B, T), detached, e.g. ``CorrectionOutput.weights``; None = 1.
    """
    penalty = coef * kl_penalty(inp, estimator)
    if weights is None:
        return penalty
    return torch.where(inp.mask > 0, weights.to(penalty.dtype) * penalty, 0.0)
