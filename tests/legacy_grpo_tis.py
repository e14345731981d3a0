"""The learner's loss before the algorithm registry: GRPO advantages and token-TIS policy gradient.

Nothing in asyncrl uses it, and no algorithm test compares against it any more (the loop references of
``tests/test_algorithms_*.py`` cover the maths). It stays only while ``tests/test_loss.py`` still tests
it for its own sake; delete it together with those tests.

Notation (per response token t of sequence i): ``pi`` the learner's policy (carries gradient), ``mu``
the behaviour policy, ``A_i`` the group-relative advantage, ``w_t = min(pi / mu, C)`` detached; the
surrogate per token is ``-w_t * A * pi / sg(pi)``. The loss is ``sum mask * token_loss / N`` with N the
GLOBAL number of response tokens of the optimizer step, so any split of the batch sums to the whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PolicyBatch:
    """One (micro-)batch of response tokens, aligned position by position."""

    logprobs: Tensor  # (B, T) log pi_theta(a_t | s_t) of the taken tokens; requires grad
    behaviour_logprobs: Tensor  # (B, T) log mu(a_t | s_t) recorded by the generator at sampling time
    advantages: Tensor  # (B,) one advantage per sequence, or (B, T) per token
    mask: Tensor  # (B, T) 1.0 on response tokens, 0.0 on prompt / padding

    def __post_init__(self) -> None:
        shape = tuple(self.logprobs.shape)
        if len(shape) != 2:
            raise ValueError(f"logprobs must be (B, T), got {shape}")
        for name in ("behaviour_logprobs", "mask"):
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"{name} has shape {got}, expected {shape} like logprobs")
        if tuple(self.advantages.shape) not in {shape, shape[:1]}:
            raise ValueError(f"advantages must be (B,) or (B, T) = {shape}, got {tuple(self.advantages.shape)}")


@dataclass
class LossOutput:
    """The scalar to backpropagate plus float diagnostics (all over masked tokens of this batch)."""

    loss: Tensor  # () sum(mask * token_loss) / total_tokens
    tis_clip_frac: float  # fraction of response tokens whose raw weight pi/mu exceeded the cap
    tis_weight_mean: float  # mean of the applied (capped) weights min(pi/mu, C)
    tis_weight_max: float  # max of the applied (capped) weights (<= C)
    behaviour_kl: float  # k3 estimate of KL(mu || pi): mean of (r - 1) - log r, r = pi/mu
    logprob_mismatch: float  # mean |log pi - log mu|
    num_tokens: float  # response tokens in this batch (sum of mask)


# ----------------------------------------------------------------------------- advantages


def group_advantages(rewards: Tensor, normalize_std: bool, eps: float) -> Tensor:
    """Group-relative advantages, one group (one prompt's n samples) per row.

    rewards: (G, n). Returns (G, n): ``(r - mean_g)`` (Dr.GRPO) or ``(r - mean_g) / (std_g + eps)``
    (GRPO). ``std_g`` is the POPULATION std (``unbiased=False``): it is defined for n = 1 and gives 0
    advantage for a group whose rewards are all equal (such a group carries no learning signal).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (G, n), got {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centred
    return centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)


# ----------------------------------------------------------------------------- losses


def _masked_mean(x: Tensor, mask: Tensor, count: float) -> float:
    return float((x * mask).sum()) / count if count > 0 else 0.0


def grpo_tis_loss(batch: PolicyBatch, tis_cap: float, total_tokens: float) -> LossOutput:
    """GRPO policy-gradient loss with token-level truncated importance sampling.

    token_loss_t = -w_t * A * exp(log pi_t - sg(log pi_t)),  w_t = sg(min(exp(log pi_t - log mu_t), C))

    ``total_tokens`` is the global count of response tokens in the optimizer step (over all
    micro-batches and ranks), NOT this batch's count: summing this function's loss over any split of
    the step's batch reproduces the full-batch loss. Frameworks that rescale undo this: DeepSpeed and
    DDP AVERAGE gradients over the L data-parallel ranks, and DeepSpeed's ``engine.backward`` also
    divides by ``gradient_accumulation_steps`` (S); pass ``total_tokens / (L * S)`` (or switch those
    scalings off) so the applied gradient is the full-batch one.
    """
    if not total_tokens > 0:
        raise ValueError(f"total_tokens must be > 0, got {total_tokens}")
    logp = batch.logprobs
    mask = batch.mask.to(logp.dtype)
    adv = batch.advantages.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    on = mask > 0
    # log(pi / mu), forced to 0 off the response so junk in padded behaviour slots cannot leak in.
    log_ratio = torch.where(on, logp.detach() - batch.behaviour_logprobs.to(logp.dtype), 0.0)
    raw_w = torch.exp(log_ratio)
    w = torch.clamp(raw_w, max=tis_cap)
    ratio = torch.exp(logp - logp.detach())  # == 1 in value; its gradient is grad log pi
    token_loss = -w * adv * ratio
    loss = (token_loss * mask).sum() / total_tokens

    with torch.no_grad():
        n = float(mask.sum())
        k3 = torch.expm1(log_ratio) - log_ratio
        return LossOutput(
            loss=loss,
            tis_clip_frac=_masked_mean((raw_w > tis_cap).to(logp.dtype), mask, n),
            tis_weight_mean=_masked_mean(w, mask, n),
            tis_weight_max=float(w[on].max()) if n > 0 else 0.0,
            behaviour_kl=_masked_mean(k3, mask, n),
            logprob_mismatch=_masked_mean(log_ratio.abs(), mask, n),
            num_tokens=n,
        )
