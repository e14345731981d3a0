"""Policy losses, loss aggregation and the PPO critic loss, as pure functions over typed inputs.

Notation (sequence i, response token t): pi = pi_theta(a_t | s_t) (carries gradient); pi_old = the
ratio's anchor (pi_prox, the policy at the start of the optimizer step, whenever a correction weights
the loss; the behaviour policy mu under correction ``none``: see ``corrections.py``); r_t = pi / pi_old;
A_{i,t} the advantage; w_{i,t} a DETACHED per-token weight from an off-policy correction (IS weight of
pi_old against mu; 0 for a rejected token); m_{i,t} the response mask.

Padding: every (B, T) input is replaced by 0 off the response BEFORE any arithmetic, so junk there
(nan, inf) reaches neither a value nor a gradient. At a kink (a clip edge, a tie of the max) the
gradient is one of the one-sided ones (``torch.where``, never the split of ``torch.maximum``).

A policy loss returns the UNAGGREGATED per-token loss l_{i,t} (weights applied, 0 off the response);
an aggregation from ``AGGREGATIONS`` turns it into the scalar to backpropagate:

* ``token-mean``:           L = sum_{i,t} m l / N_tok
* ``seq-mean-token-mean``:  L = sum_i (sum_t m l / |y_i|) / N_seq
* ``seq-mean-token-sum``:   L = sum_{i,t} m l / (N_seq * L_max)      (Dr.GRPO: a CONSTANT length)

N_tok, N_seq are GLOBAL counts of the optimizer step (all micro-batches, all learner ranks) and
|y_i| is sequence i's own length (a sequence is never split), so summing the loss of any partition of
the step's batch gives exactly the full-batch loss and gradient. DeepSpeed/DDP AVERAGE gradients over
L ranks and DeepSpeed's ``backward`` divides by S accumulation steps: pass counts divided by L * S
(``LossCounts.scaled``) so the applied gradient is the full-batch one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl.config.pieces import PolicyLossConfig, lookup
from asyncrl.learners.batching import masked_mean

__all__ = [
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "AggregationFn",
    "LossCounts",
    "PolicyLossConfig",
    "PolicyLossFn",
    "PolicyLossInput",
    "PolicyLossOutput",
    "ValueLossInput",
    "ValueLossOutput",
    "aggregate",
    "get_aggregation",
    "get_policy_loss",
    "gspo_loss",
    "policy_gradient_loss",
    "ppo_clip_loss",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "token_mean",
    "value_loss",
]


# ----------------------------------------------------------------------------- typed inputs/outputs


def _check_like(shape: tuple, **tensors: Tensor | None) -> None:
    for name, value in tensors.items():
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape}")


@dataclass
class PolicyLossInput:
    logprobs: Tensor  # (B, T) log pi_theta(a_t | s_t) of the taken tokens; requires grad
    old_logprobs: Tensor  # (B, T) log pi_old(a_t | s_t): the ratio's anchor (CorrectionOutput.old_logprobs)
    advantages: Tensor  # (B, T) A_{i,t}, or (B,) one A_i per sequence
    mask: Tensor  # (B, T) 1.0 on response tokens, 0.0 on prompt / padding
    weights: Tensor | None = None  # (B, T) detached w_{i,t} (CorrectionOutput.weights); None = 1

    def __post_init__(self) -> None:
        shape = tuple(self.logprobs.shape)
        if len(shape) != 2:
            raise ValueError(f"logprobs must be (B, T), got {shape}")
        _check_like(shape, old_logprobs=self.old_logprobs, mask=self.mask, weights=self.weights)
        if tuple(self.advantages.shape) not in {shape, shape[:1]}:
            raise ValueError(f"advantages must be (B,) or (B, T) = {shape}, got {tuple(self.advantages.shape)}")


@dataclass
class PolicyLossOutput:
    """Per-token loss plus float diagnostics over this batch's response tokens."""

    token_loss: Tensor  # (B, T) l_{i,t}, weights applied, 0 off the response: pass to an aggregation
    clip_frac: float  # fraction of response tokens on a clipped branch (no gradient through them)
    dual_clip_frac: float  # fraction of response tokens capped by the dual clip
    ratio_mean: float  # mean ratio r (gspo: the sequence ratio s_i on each of its tokens)
    ratio_max: float  # max ratio r
    approx_kl: float  # k3 estimate of KL(pi_old || pi_theta): mean (r - 1) - log r


@dataclass(frozen=True)
class LossCounts:
    """GLOBAL normalisers of one optimizer step (every micro-batch on every learner rank)."""

    num_tokens: float  # N_tok: response tokens in the step
    num_sequences: float  # N_seq: sequences in the step
    max_len: float | None = None  # L_max: the constant of seq-mean-token-sum (the generation max_tokens)

    def scaled(self, divisor: float) -> LossCounts:
        """Counts divided by L * S (ranks x accumulation steps) for engines that average gradients."""
        return LossCounts(self.num_tokens / divisor, self.num_sequences / divisor, self.max_len)


# ----------------------------------------------------------------------------- policy losses

# log r is clamped to [-20, 20] before exp. float32 exp overflows past 88.7, and exp's backward
# multiplies by exp(x): inf there gives 0 * inf = NaN even on a clipped branch (or with A = 0, w = 0).
# e^20 ~ 4.9e8 keeps r * A * w and its sums finite in float32 with room to spare, and is far past any
# ratio a clip keeps (1 +- 0.2; GSPO 1 +- 4e-4): beyond it J is flat for A > 0 (clipped anyway) and, for
# A < 0, capped at e^20 |A| with no gradient (a dual clip at c = e^20), where the true r A is garbage.
_LOG_RATIO_CLAMP = 20.0


def _prepare(inp: PolicyLossInput) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(on, log pi, log r, A as (B, T), w), each 0 off the response: junk in padded slots cannot leak in.

    log pi is masked before any arithmetic: torch.where's backward gives a padded slot exactly 0, and
    nothing downstream multiplies a gradient by its junk. log r is NOT clamped here (see ``_exp``).
    """
    on = inp.mask > 0
    lp = torch.where(on, inp.logprobs, 0.0)
    adv = inp.advantages.to(lp.dtype)
    adv = torch.where(on, adv[:, None] if adv.dim() == 1 else adv, 0.0)
    log_ratio = lp - torch.where(on, inp.old_logprobs.to(lp.dtype), 0.0)
    w = on.to(lp.dtype) if inp.weights is None else torch.where(on, inp.weights.to(lp.dtype), 0.0)
    return on, lp, log_ratio, adv, w


def _clamp(log_ratio: Tensor) -> Tensor:
    return log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _clipped_surrogate(ratio: Tensor, adv: Tensor, cfg: PolicyLossConfig) -> tuple[Tensor, Tensor, Tensor]:
    """l = max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A), then min(l, -c A) where A < 0 (dual clip).

    Returns (l, on_clipped_branch, dual_clipped) -- both masks mark tokens whose gradient is 0.
    """
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    clipped_branch = clipped > unclipped
    loss = torch.where(clipped_branch, clipped, unclipped)  # max(unclipped, clipped); a tie takes unclipped
    dual = torch.zeros_like(clipped_branch)
    if cfg.dual_clip is not None:
        bound = -cfg.dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return loss, clipped_branch & ~dual, dual


def _output(
    token_loss: Tensor, inp: PolicyLossInput, ratio: Tensor, log_ratio: Tensor, clip: Tensor, dual: Tensor
) -> PolicyLossOutput:
    with torch.no_grad():
        mask = inp.mask.to(token_loss.dtype)
        n = float(mask.sum())
        on = mask > 0
        ratio, log_ratio = ratio.detach(), log_ratio.detach()
        return PolicyLossOutput(
            token_loss=token_loss,
            clip_frac=masked_mean(clip.to(mask.dtype), mask, n),
            dual_clip_frac=masked_mean(dual.to(mask.dtype), mask, n),
            ratio_mean=masked_mean(ratio, mask, n),
            ratio_max=float(ratio[on].max()) if n > 0 else 0.0,
            approx_kl=masked_mean(torch.expm1(log_ratio) - log_ratio, mask, n),
        )


def ppo_clip_loss(inp: PolicyLossInput, cfg: PolicyLossConfig) -> PolicyLossOutput:
    """PPO clip (Schulman et al. 2017) with DAPO's separate eps_low / eps_high and optional dual clip.

    l_t = w_t * max(-r_t A_t, -clip(r_t, 1 - eps_low, 1 + eps_high) A_t),   r_t = pi / pi_old;
    dual clip (A_t < 0): l_t = w_t * min(that, -c A_t). dl/dlog pi = -w r A on the unclipped branch, else 0.
    log r is clamped to +-20 before exp (``_LOG_RATIO_CLAMP``).
    """
    on, _, log_ratio, adv, w = _prepare(inp)
    log_ratio = _clamp(log_ratio)
    ratio = torch.exp(log_ratio)
    loss, clip, dual = _clipped_surrogate(ratio, adv, cfg)
    return _output(torch.where(on, w * loss, 0.0), inp, ratio, log_ratio, clip, dual)


def gspo_loss(inp: PolicyLossInput, cfg: PolicyLossConfig) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025), in its GSPO-token form.

    s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp((1/|y_i|) sum_t log r_{i,t})   (length-normalised);
    s_{i,t} = sg(s_i) * pi_t / sg(pi_t)   (value s_i, gradient s_i grad log pi_t);
    l_{i,t} = w_t * max(-s_{i,t} A_{i,t}, -clip(s_{i,t}, 1 - eps_low, 1 + eps_high) A_{i,t}).
    With A_{i,t} = A_i, w = 1 and ``seq-mean-token-mean`` this IS the sequence-level GSPO objective,
    value and gradient: a sequence is clipped as a whole. Its eps are ~1e-3, not PPO's 0.2.
    The sequence's mean log r is clamped to +-20 before exp (``_LOG_RATIO_CLAMP``).
    """
    on, lp, log_ratio, adv, w = _prepare(inp)
    lengths = on.sum(dim=1, keepdim=True).clamp(min=1)
    seq_log_ratio = _clamp(log_ratio.detach().sum(dim=1, keepdim=True) / lengths)
    ratio = torch.where(on, torch.exp(seq_log_ratio + lp - lp.detach()), 1.0)
    loss, clip, dual = _clipped_surrogate(ratio, adv, cfg)
    return _output(torch.where(on, w * loss, 0.0), inp, ratio, _clamp(log_ratio), clip, dual)


def policy_gradient_loss(inp: PolicyLossInput, cfg: PolicyLossConfig) -> PolicyLossOutput:
    """Plain (REINFORCE) policy gradient: l_t = -w_t A_t pi / sg(pi).

    Value -w A, gradient -w A grad log pi; pi_old and the clip settings are unused (off-policy
    correction comes only from w).
    """
    on, lp, log_ratio, adv, w = _prepare(inp)
    token_loss = torch.where(on, -w * adv * torch.exp(lp - lp.detach()), 0.0)
    none = torch.zeros_like(on)
    log_ratio = _clamp(log_ratio)  # the ratio is only reported
    return _output(token_loss, inp, torch.exp(log_ratio), log_ratio, none, none)


# ----------------------------------------------------------------------------- aggregation


def _positive(value: float | None, what: str) -> float:
    if value is None or not value > 0:
        raise ValueError(f"{what} must be > 0, got {value}")
    return float(value)


def token_mean(token_loss: Tensor, mask: Tensor, counts: LossCounts) -> Tensor:
    """L = sum_{i,t} m l / N_tok (global token count)."""
    return torch.where(mask > 0, token_loss, 0.0).sum() / _positive(counts.num_tokens, "num_tokens")


def seq_mean_token_mean(token_loss: Tensor, mask: Tensor, counts: LossCounts) -> Tensor:
    """L = sum_i (sum_t m l / |y_i|) / N_seq; a sequence without response tokens contributes 0."""
    on = mask > 0
    per_seq = torch.where(on, token_loss, 0.0).sum(dim=1) / on.sum(dim=1).clamp(min=1)
    return per_seq.sum() / _positive(counts.num_sequences, "num_sequences")


def seq_mean_token_sum(token_loss: Tensor, mask: Tensor, counts: LossCounts) -> Tensor:
    """L = sum_{i,t} m l / (N_seq * L_max) (Dr.GRPO): no per-sequence length normalisation."""
    denominator = _positive(counts.num_sequences, "num_sequences") * _positive(counts.max_len, "max_len")
    return torch.where(mask > 0, token_loss, 0.0).sum() / denominator


# ----------------------------------------------------------------------------- PPO critic


@dataclass
class ValueLossInput:
    values: Tensor  # (B, T) V_phi(s_t), requires grad
    old_values: Tensor  # (B, T) V_phi_old(s_t) recorded when the advantages were computed
    returns: Tensor  # (B, T) targets R_t (AdvantageOutput.returns)
    mask: Tensor  # (B, T) 1.0 on response tokens

    def __post_init__(self) -> None:
        _check_like(tuple(self.values.shape), old_values=self.old_values, returns=self.returns, mask=self.mask)


@dataclass
class ValueLossOutput:
    token_loss: Tensor  # (B, T) 0.5 * max((V - R)^2, (V_clip - R)^2), 0 off the response
    clip_frac: float  # fraction of response tokens where the clip binds and its term is the larger (no gradient)
    value_error: float  # mean (V - R)^2 over response tokens


def value_loss(inp: ValueLossInput, clip: float | None) -> ValueLossOutput:
    """PPO critic loss with value clipping: V_clip = V_old + clip(V - V_old, -eps_v, eps_v),
    l_t = 0.5 * max((V_t - R_t)^2, (V_clip,t - R_t)^2); ``clip=None`` gives 0.5 (V - R)^2.

    The clipped term is taken only where the clip binds (|V - V_old| > eps_v) and is the larger; there
    V_clip does not depend on V: no gradient. Padded slots of every input are 0 before any arithmetic.
    """
    on = inp.mask > 0
    values = torch.where(on, inp.values, 0.0)
    returns = torch.where(on, inp.returns.to(values.dtype), 0.0)
    unclipped = (values - returns) ** 2
    if clip is None:
        loss, clipped = unclipped, torch.zeros_like(on)
    else:
        old = torch.where(on, inp.old_values.to(values.dtype), 0.0)
        step = values - old
        v_clip = old + torch.clamp(step, -_positive(clip, "value clip"), clip)
        clipped_sq = (v_clip - returns) ** 2
        clipped = (step.abs() > clip) & (clipped_sq > unclipped)
        loss = torch.where(clipped, clipped_sq, unclipped)
    token_loss = torch.where(on, 0.5 * loss, 0.0)
    mask = inp.mask.to(values.dtype)
    n = float(mask.sum())
    return ValueLossOutput(
        token_loss=token_loss,
        clip_frac=masked_mean(clipped.to(mask.dtype), mask, n),
        value_error=masked_mean(unclipped.detach(), mask, n),
    )


# ----------------------------------------------------------------------------- registries

PolicyLossFn = Callable[[PolicyLossInput, PolicyLossConfig], PolicyLossOutput]
AggregationFn = Callable[[Tensor, Tensor, LossCounts], Tensor]

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "policy_gradient": policy_gradient_loss,
}
AGGREGATIONS: dict[str, AggregationFn] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
}


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered under ``name`` (``POLICY_LOSSES``); UserError listing known names if none."""
    return lookup(POLICY_LOSSES, "policy loss", name)


def get_aggregation(name: str) -> AggregationFn:
    """The aggregation registered under ``name`` (``AGGREGATIONS``); UserError listing known names if none."""
    return lookup(AGGREGATIONS, "aggregation", name)


def aggregate(name: str, token_loss: Tensor, mask: Tensor, counts: LossCounts) -> Tensor:
    """The scalar loss: ``AGGREGATIONS[name](token_loss, mask, counts)``."""
    return get_aggregation(name)(token_loss, mask, counts)
