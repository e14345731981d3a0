"""``algorithm``: a preset by name (``asyncrl.config.presets``) with any of its pieces and defaults overridden."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from asyncrl.config.base import Section
from asyncrl.config.pieces import (
    AdvantageName,
    AggregationName,
    CorrectionName,
    KlEstimatorName,
    PolicyLossName,
    PresetName,
)
from asyncrl.errors import UserError


class AlgorithmConfig(Section):
    """A preset by name; every other field left unset (null) takes the preset's value (docs/algorithms.md)."""

    name: PresetName = Field("grpo", description="Algorithm preset: expands to the pieces below.")
    advantage: AdvantageName | None = Field(None, description="Advantage estimator (gae needs a critic).")
    policy_loss: PolicyLossName | None = Field(None, description="Policy loss.")
    aggregation: AggregationName | None = Field(
        None, description="How token losses become the step's loss, normalised by GLOBAL counts over ranks."
    )
    correction: CorrectionName | None = Field(
        None, description="Off-policy correction against the behaviour log-probs (vtrace needs a critic)."
    )
    kl_placement: Literal["none", "reward", "loss"] | None = Field(
        None, description="KL(pi || reference) folded into the token reward, added as a loss term, or off."
    )
    kl_estimator: KlEstimatorName | None = Field(None, description="KL estimator (Schulman 2020).")
    kl_coef: float | None = Field(None, ge=0, description="beta; 0 = no KL and no reference model.")
    clip_low: float | None = Field(None, ge=0, lt=1, description="PPO ratio clipped below at 1 - clip_low.")
    clip_high: float | None = Field(None, ge=0, description="PPO ratio clipped above at 1 + clip_high (clip-higher).")
    dual_clip: float | None = Field(
        None, gt=1, description="c > 1: caps the loss of negative-advantage tokens at -c A (null: off)."
    )
    tis_cap: float | None = Field(None, gt=0, description="C of tis / decoupled_ppo: weights min(rho, C).")
    seq_tis_cap: float | None = Field(None, gt=0, description="C of seq_tis: min(prod_t rho_t, C) per sequence.")
    icepop_low: float | None = Field(None, ge=0, description="icepop keeps tokens with rho in [low, high].")
    icepop_high: float | None = Field(None, gt=0, description="icepop upper bound.")
    geo_low: float | None = Field(
        None, ge=0, description="geo_mask keeps sequences whose geometric-mean rho is in [low, high]."
    )
    geo_high: float | None = Field(None, gt=0, description="geo_mask upper bound.")
    rho_bar: float | None = Field(None, gt=0, description="V-trace truncation of the policy-gradient / TD weights.")
    c_bar: float | None = Field(None, gt=0, description="V-trace truncation of the trace.")
    gamma: float | None = Field(
        None, ge=0, le=1, description="Discount per response token (gae, reinforce_pp*, vtrace)."
    )
    lam: float | None = Field(None, ge=0, le=1, description="GAE lambda.")
    normalize_std: bool | None = Field(
        None, description="Group estimators: true = grpo (divide by the group std), false = dr_grpo."
    )
    adv_eps: float | None = Field(None, gt=0, description="Added to a std before dividing.")
    value_clip: float | None = Field(None, gt=0, description="Critic value clipping eps_v (critic presets).")
    value_coef: float | None = Field(None, gt=0, description="Weight of the critic loss (its own optimizer).")
    critic_lr: float | None = Field(None, gt=0, description="Critic learning rate (null: learner.lr).")
    overlong_buffer: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="DAPO soft overlong punishment: the last this fraction of generator.max_new_tokens is "
        "penalised linearly, down to -overlong_penalty at the limit (0: off).",
    )
    overlong_penalty: float | None = Field(None, ge=0, description="Penalty at the length limit.")
    dynamic_filtering: bool | None = Field(
        None, description="Drop groups whose rewards are all equal (DAPO); or'ed with buffer.filter_zero_variance."
    )
    routing_replay: bool = Field(
        False,
        description="Rollout routing replay (R3), for a mixture of experts: the vLLM engine records the experts "
        "each token was routed to, and the learner's forward uses them instead of its own top-k (the router's "
        "weights still get gradient through the gates). Runs the engine without prefix caching.",
    )

    _preset: Any = PrivateAttr(None)

    @model_validator(mode="after")
    def _resolve(self) -> AlgorithmConfig:
        # The learner builds exactly this preset: resolving it here makes --dry-run reject whatever a
        # learner rank would (presets and learners.pieces import no torch: reading a config stays cheap).
        from asyncrl.config.presets import from_config

        try:
            self._preset = from_config(self)
        except UserError as exc:
            raise ValueError(str(exc).removeprefix("algorithm: ")) from None
        return self

    @property
    def preset(self):
        """The resolved ``asyncrl.config.presets.Preset``: the pieces a learner step composes."""
        return self._preset
