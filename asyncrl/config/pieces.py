"""The torch-free half of the algorithm registries: each piece's parameters (the frozen configs of the
advantage estimators, policy losses and corrections) and the registry lookup, so that a preset is built
and validated without torch: the launcher, ``--dry-run`` and ``asyncrl status`` read configs in a
fraction of a second. The registries that map names to functions live beside their formulas
(``advantages``, ``policy_losses``, ``corrections``, ``kl``); their names are spelled out here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from asyncrl.errors import UserError

# The registries' keys (learners/{presets,advantages,policy_losses,corrections,kl}.py), spelled out so that
# validating a config does not import torch; tests/learners/test_learner_algorithms.py checks they match.
PresetName = Literal["ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "gspo"]
AdvantageName = Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
PolicyLossName = Literal["ppo_clip", "gspo", "policy_gradient"]
AggregationName = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
CorrectionName = Literal["none", "tis", "seq_tis", "icepop", "geo_mask", "decoupled_ppo", "vtrace"]
KlEstimatorName = Literal["k1", "k2", "k3"]


def lookup(registry: dict, kind: str, name: str) -> Callable:
    """``registry[name]``; a UserError naming the ``kind`` and listing the known names if absent."""
    try:
        return registry[name]
    except KeyError:
        raise UserError(f"unknown {kind} {name!r}; known: {', '.join(sorted(registry))}") from None


@dataclass(frozen=True)
class AdvantageConfig:
    """Parameters shared by the estimators; each reads only the fields its formula has."""

    gamma: float = 1.0  # discount per response token (1: outcome rewards reach every token unshrunk)
    lam: float = 0.95  # GAE lambda: bias (0, one-step TD) vs variance (1, Monte Carlo)
    eps: float = 1e-6  # added to a std before dividing (all-equal groups / batches give 0, not NaN)

    def __post_init__(self) -> None:
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"gamma and lam must lie in [0, 1], got {self.gamma}, {self.lam}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")


@dataclass(frozen=True)
class PolicyLossConfig:
    clip_low: float = 0.2  # eps_low: the ratio is clipped below at 1 - eps_low
    clip_high: float = 0.2  # eps_high: clipped above at 1 + eps_high (DAPO clip-higher: 0.28)
    dual_clip: float | None = None  # c > 1: caps the loss of A < 0 tokens at -c A (Ye et al. 2020); None = off

    def __post_init__(self) -> None:
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip c must be > 1, got {self.dual_clip}")


@dataclass(frozen=True)
class CorrectionConfig:
    """Parameters of every correction; each reads only its own fields."""

    tis_cap: float = 2.0  # C of tis / decoupled_ppo: w = min(rho, C) bounds the variance
    seq_tis_cap: float = 2.0  # C of seq_tis: w_i = min(prod_t rho_t, C)
    icepop_low: float = 0.5  # icepop keeps tokens with rho in [low, high] (IcePop's alpha, beta)
    icepop_high: float = 5.0
    geo_low: float = 0.999  # geo_mask keeps sequences whose geometric-mean ratio is in [low, high];
    geo_high: float = 1.001  # per-token mismatch is ~1e-3, so the band is that tight
    rho_bar: float = 1.0  # V-trace: truncation of the policy-gradient / TD weights (the fixed point's policy)
    c_bar: float = 1.0  # V-trace: truncation of the trace (contraction speed)
    gamma: float = 1.0  # V-trace discount per response token

    def __post_init__(self) -> None:
        for name in ("tis_cap", "seq_tis_cap", "icepop_high", "geo_high", "rho_bar", "c_bar"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for band in ("icepop", "geo"):
            low, high = getattr(self, f"{band}_low"), getattr(self, f"{band}_high")
            if not 0 <= low <= high:
                raise ValueError(f"need 0 <= {band}_low <= {band}_high, got {band}_low={low}, {band}_high={high}")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma must lie in [0, 1], got {self.gamma}")
