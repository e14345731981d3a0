"""Algorithm presets: a name expands to the pieces (estimator, loss, aggregation, correction, KL) and
their defaults, as a frozen dataclass. Switching algorithm = switching preset name; overriding one
default = ``dataclasses.replace(get_preset("grpo"), kl_coef=0.0)``.

Defaults follow each method's paper. For asynchronous training every clipped preset uses decoupled PPO
(clip pi / pi_prox, weight min(pi_prox / mu, C)): clipping against a stale mu would zero the gradient
of most tokens. GSPO instead anchors on mu (its sequence-level ratio tolerates the mismatch), and the
unclipped RLOO relies on token TIS alone. ``required_inputs`` says what the learner must supply.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import get_args

from asyncrl.config import pieces
from asyncrl.config.pieces import AdvantageConfig, CorrectionConfig, PolicyLossConfig, lookup
from asyncrl.errors import UserError

__all__ = ["KL_PLACEMENTS", "PRESETS", "Preset", "from_config", "get_preset"]

KL_PLACEMENTS = ("none", "reward", "loss")

# What each piece needs from the learner beyond logprobs, behaviour_logprobs, mask, rewards and the
# global token / sequence counts (which every preset needs).
_ADVANTAGE_NEEDS = {
    "gae": {"values", "old_values"},
    "grpo": {"group_ids"},
    "dr_grpo": {"group_ids"},
    "rloo": {"group_ids"},
    "reinforce_pp_baseline": {"group_ids"},
}
_CORRECTION_NEEDS = {"decoupled_ppo": {"prox_logprobs"}, "vtrace": {"values"}}
_AGGREGATION_NEEDS = {"seq-mean-token-sum": {"max_len"}}
# A ratio loss (a trust region r = pi / anchor) under any correction but "none" gets pi_prox as the
# correction's target AND the ratio's anchor: w(pi_prox / mu) * min(r A, clip(r) A), r = pi / pi_prox
# (Truncated IS, IcePop, decoupled PPO). Anchoring on mu as well would apply the weight twice. With
# "none" it stays plain PPO on behaviour data (anchor mu, w = 1); policy_gradient weights by pi / mu.
_RATIO_LOSS_NEEDS = {"ppo_clip": {"prox_logprobs"}, "gspo": {"prox_logprobs"}}


@dataclass(frozen=True)
class Preset:
    """One algorithm as pieces from the registries; validated on construction (UserError)."""

    name: str
    advantage: str  # ADVANTAGES key
    policy_loss: str  # POLICY_LOSSES key
    aggregation: str  # AGGREGATIONS key, applied to the policy loss, the KL loss and the value loss
    correction: str  # CORRECTIONS key
    kl_placement: str = "none"  # "none" | "reward" (kl.kl_reward -> token_rewards) | "loss" (kl.kl_loss)
    kl_estimator: str = "k1"  # KL_ESTIMATORS key
    kl_coef: float = 0.0  # beta
    value_clip: float | None = None  # PPO critic: eps_v of value_loss (gae presets only)
    value_coef: float = 0.0  # weight of the critic loss added to the policy loss (gae presets only)
    overlong_buffer: float = 0.0  # DAPO soft overlong punishment: penalised fraction of max_len (0: off)
    overlong_penalty: float = 1.0  # the reward penalty at max_len (advantages.overlong_penalty)
    dynamic_filtering: bool = False  # DAPO: drop groups whose rewards are all equal (done by the buffer)
    advantage_config: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss_config: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    correction_config: CorrectionConfig = field(default_factory=CorrectionConfig)

    def __post_init__(self) -> None:
        for kind, names, name in (  # the registries' names, spelled out in pieces: no torch here
            ("advantage estimator", pieces.AdvantageName, self.advantage),
            ("policy loss", pieces.PolicyLossName, self.policy_loss),
            ("aggregation", pieces.AggregationName, self.aggregation),
            ("correction", pieces.CorrectionName, self.correction),
            ("KL estimator", pieces.KlEstimatorName, self.kl_estimator),
        ):
            lookup(dict.fromkeys(get_args(names)), kind, name)
        if self.kl_placement not in KL_PLACEMENTS:
            raise UserError(f"unknown KL placement {self.kl_placement!r}; known: {', '.join(KL_PLACEMENTS)}")
        if self.kl_coef < 0:
            raise UserError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if not 0 <= self.overlong_buffer < 1:
            raise UserError(f"overlong_buffer must lie in [0, 1), got {self.overlong_buffer}")

    @property
    def uses_kl(self) -> bool:
        """Whether a reference model is needed at all."""
        return self.kl_placement != "none" and self.kl_coef > 0

    @property
    def needs_critic(self) -> bool:
        return "values" in self.required_inputs

    @property
    def required_inputs(self) -> frozenset[str]:
        """Inputs the learner must provide beyond logprobs, behaviour_logprobs, mask, rewards, counts."""
        needs = set(_ADVANTAGE_NEEDS.get(self.advantage, ()))
        needs |= _CORRECTION_NEEDS.get(self.correction, set())
        if self.correction != "none":
            needs |= _RATIO_LOSS_NEEDS.get(self.policy_loss, set())
        needs |= _AGGREGATION_NEEDS.get(self.aggregation, set())
        if self.uses_kl:
            needs.add("ref_logprobs")
        return frozenset(needs)


def _clipped(name: str, advantage: str, aggregation: str, **kw) -> Preset:
    return Preset(
        name=name,
        advantage=advantage,
        policy_loss="ppo_clip",
        aggregation=aggregation,
        correction="decoupled_ppo",
        **kw,
    )


PRESETS: dict[str, Preset] = {
    # Ouyang et al. 2022 / OpenRLHF: GAE critic, k1 KL folded into the token reward, value clipping.
    "ppo": _clipped(
        "ppo",
        "gae",
        "token-mean",
        kl_placement="reward",
        kl_estimator="k1",
        kl_coef=0.01,
        value_clip=0.2,
        value_coef=0.5,
        advantage_config=AdvantageConfig(gamma=1.0, lam=0.95),
    ),
    # Shao et al. 2024: group-normalised outcome, per-sequence token mean, k3 KL loss with beta 0.04.
    "grpo": _clipped("grpo", "grpo", "seq-mean-token-mean", kl_placement="loss", kl_estimator="k3", kl_coef=0.04),
    # Liu et al. 2025: no std division, no per-sequence length division (constant L_max), no KL.
    "dr_grpo": _clipped("dr_grpo", "dr_grpo", "seq-mean-token-sum"),
    # Ahmadian et al. 2024: leave-one-out baseline, unclipped REINFORCE, KL folded into the reward.
    "rloo": Preset(
        name="rloo",
        advantage="rloo",
        policy_loss="policy_gradient",
        aggregation="token-mean",
        correction="tis",
        kl_placement="reward",
        kl_estimator="k1",
        kl_coef=0.05,
    ),
    # Hu 2025: token-level k1 KL in the reward, batch-normalised returns, PPO clip.
    "reinforce_pp": _clipped(
        "reinforce_pp", "reinforce_pp", "token-mean", kl_placement="reward", kl_estimator="k1", kl_coef=0.01
    ),
    # Hu 2025 (baseline variant, outcome rewards): group-mean baseline then batch normalisation, k2 KL loss.
    "reinforce_pp_baseline": _clipped(
        "reinforce_pp_baseline",
        "reinforce_pp_baseline",
        "token-mean",
        kl_placement="loss",
        kl_estimator="k2",
        kl_coef=0.001,
    ),
    # Yu et al. 2025: clip-higher (0.2 / 0.28), token-mean over the step, no KL, dynamic filtering, soft
    # overlong punishment over the last 20% of the length limit (their 4096 of 20480 tokens).
    "dapo": _clipped(
        "dapo",
        "grpo",
        "token-mean",
        loss_config=PolicyLossConfig(clip_low=0.2, clip_high=0.28),
        overlong_buffer=0.2,
        dynamic_filtering=True,
    ),
    # Zheng et al. 2025: sequence-level ratio, eps 3e-4 / 4e-4, anchored on mu, no KL.
    "gspo": Preset(
        name="gspo",
        advantage="grpo",
        policy_loss="gspo",
        aggregation="seq-mean-token-mean",
        correction="none",
        loss_config=PolicyLossConfig(clip_low=3e-4, clip_high=4e-4),
    ),
}


def get_preset(name: str) -> Preset:
    """The preset registered under ``name`` (``PRESETS``); UserError listing known names if none."""
    return lookup(PRESETS, "preset", name)


def _set(**fields):
    """The fields that are not None (config fields left unset keep the preset's value)."""
    return {k: v for k, v in fields.items() if v is not None}


def from_config(algo) -> Preset:
    """``algorithm`` config section (asyncrl.config.AlgorithmConfig) -> its preset with the overrides applied."""
    base = get_preset(algo.name)
    advantage = algo.advantage or base.advantage
    if algo.normalize_std is not None:
        if advantage not in ("grpo", "dr_grpo"):
            raise UserError(f"algorithm.normalize_std applies to the grpo / dr_grpo estimators, not {advantage}")
        advantage = "grpo" if algo.normalize_std else "dr_grpo"
    try:
        adv_cfg = replace(base.advantage_config, **_set(gamma=algo.gamma, lam=algo.lam, eps=algo.adv_eps))
        loss_cfg = replace(base.loss_config, **_set(clip_low=algo.clip_low, clip_high=algo.clip_high))
        if algo.dual_clip is not None:
            loss_cfg = replace(loss_cfg, dual_clip=algo.dual_clip)
        corr_cfg = replace(
            base.correction_config,
            **_set(
                tis_cap=algo.tis_cap,
                seq_tis_cap=algo.seq_tis_cap,
                icepop_low=algo.icepop_low,
                icepop_high=algo.icepop_high,
                geo_low=algo.geo_low,
                geo_high=algo.geo_high,
                rho_bar=algo.rho_bar,
                c_bar=algo.c_bar,
                gamma=algo.gamma,
            ),
        )
    except ValueError as exc:
        raise UserError(f"algorithm: {exc}") from None
    pieces = _set(
        policy_loss=algo.policy_loss,
        aggregation=algo.aggregation,
        correction=algo.correction,
        kl_placement=algo.kl_placement,
        kl_estimator=algo.kl_estimator,
        kl_coef=algo.kl_coef,
        value_clip=algo.value_clip,
        value_coef=algo.value_coef,
        overlong_buffer=algo.overlong_buffer,
        overlong_penalty=algo.overlong_penalty,
        dynamic_filtering=algo.dynamic_filtering,
    )
    preset = replace(
        base, advantage=advantage, advantage_config=adv_cfg, loss_config=loss_cfg, correction_config=corr_cfg, **pieces
    )
    if preset.needs_critic and preset.value_coef <= 0:
        preset = replace(preset, value_coef=1.0)  # a critic someone asked for by hand is trained
    return preset
