"""GRPO with a token-level truncated importance-sampling (TIS) correction, as pure functions.

Notation (per response token t of sequence i):

* ``pi``  = pi_theta(a_t | s_t), the learner's current policy (carries gradient);
* ``mu``  = the behaviour policy that sampled the token (the generator's weights, possibly ``k``
  versions stale, and a different numerical stack: vLLM vs the training kernels);
* ``A_i`` = the group-relative advantage of sequence i (or a per-token advantage A_{i,t});
* ``w_t`` = min(pi / mu, C), the truncated importance weight, DETACHED (a constant per token);
* the surrogate per token is ``-w_t * A * pi / sg(pi)``: its value is ``-w_t * A`` and its gradient is
  ``-w_t * A * grad log pi`` -- the off-policy-corrected REINFORCE gradient (no PPO clipping).

Normalisation invariant: the loss is ``sum_{i,t} mask * token_loss / N`` where ``N`` is the GLOBAL
number of response tokens in the optimizer step (all micro-batches, all learner ranks). Summing the
losses (or gradients) of any partition of the step's batch then gives exactly the full-batch loss, so
the result does not depend on the number of ranks or on gradient accumulation. With data parallelism
that averages gradients over ``L`` ranks, the caller must pass ``N / L`` (or scale by ``L``) -- see
``grpo_tis_loss``.

Alignment convention (``pad_batch`` and ``sequence_logprobs``): position ``j`` of every ``(B, L-1)``
tensor describes the token at ``input_ids[:, j + 1]`` predicted from the prefix ``input_ids[:, :j+1]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from asyncrl.errors import UserError

__all__ = [
    "ADVANTAGES",
    "LOSSES",
    "LossOutput",
    "PolicyBatch",
    "dr_grpo_advantages",
    "get_advantage",
    "get_loss",
    "group_advantages",
    "grpo_advantages",
    "grpo_tis_loss",
    "pad_batch",
    "sequence_logprobs",
]


# ----------------------------------------------------------------------------- typed inputs/outputs


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


def grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: group-centred rewards divided by the group's population std (+ eps). (G, n) -> (G, n)."""
    return group_advantages(rewards, normalize_std=True, eps=eps)


def dr_grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """Dr.GRPO: group-centred rewards, no std division (``eps`` unused). (G, n) -> (G, n)."""
    return group_advantages(rewards, normalize_std=False, eps=eps)


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


# ----------------------------------------------------------------------------- registries

LossFn = Callable[[PolicyBatch, float, float], LossOutput]
AdvantageFn = Callable[[Tensor, float], Tensor]

LOSSES: dict[str, LossFn] = {"grpo_tis": grpo_tis_loss}
ADVANTAGES: dict[str, AdvantageFn] = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages}


def _lookup(registry: dict, kind: str, name: str) -> Callable:
    try:
        return registry[name]
    except KeyError:
        raise UserError(f"unknown {kind} {name!r}; known: {', '.join(sorted(registry))}") from None


def get_loss(name: str) -> LossFn:
    """The loss function registered under ``name`` (``LOSSES``); UserError if there is none."""
    return _lookup(LOSSES, "loss", name)


def get_advantage(name: str) -> AdvantageFn:
    """The advantage function registered under ``name`` (``ADVANTAGES``); UserError if there is none."""
    return _lookup(ADVANTAGES, "advantage", name)


# ----------------------------------------------------------------------------- token log-probs


def sequence_logprobs(logits: Tensor, input_ids: Tensor, temperature: float) -> Tensor:
    """log softmax(logits[:, j] / temperature)[input_ids[:, j + 1]] for j < L-1. (B, L, V) -> (B, L-1).

    Computed in at least float32 (bf16 logits are upcast; float64 stays float64). The temperature must
    be the generator's sampling temperature, or pi and mu describe different distributions and the
    importance weights are biased. Materialises one (B, L-1, V) float32 tensor: fine for small vocabs;
    chunk over the batch for large ones.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits[:, :-1].to(dtype) / temperature, dim=-1)
    targets = input_ids[:, 1:].long().unsqueeze(-1)
    return torch.gather(logp, dim=-1, index=targets).squeeze(-1)


def pad_batch(sequences: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], pad_id: int) -> dict[str, Tensor]:
    """Right-pad (prompt_ids (P,), response_ids (T,), behaviour_logprobs (T,)) triples into tensors.

    Returns ``input_ids`` (B, L) int64 = prompt ++ response ++ pad, ``attention_mask`` (B, L) int64,
    and, aligned with ``sequence_logprobs`` output (position j predicts token j + 1):
    ``response_mask`` (B, L-1) float32, 1.0 at j = P-1 .. P+T-2 (the next token is response token
    j - P + 1), and ``behaviour_logprobs`` (B, L-1) float32 with behaviour_logprobs[P - 1 + t] = mu_t
    and 0 elsewhere. Each prompt needs P >= 1 (the first response token is predicted from it).
    Right padding keeps default position ids (0..len-1) correct for causal LMs.
    """
    if not sequences:
        raise ValueError("pad_batch needs at least one sequence")
    for i, (prompt, response, blp) in enumerate(sequences):
        if len(prompt) < 1:
            raise ValueError(f"sequence {i}: empty prompt (the first response token needs a context)")
        if len(response) != len(blp):
            raise ValueError(f"sequence {i}: {len(response)} response tokens but {len(blp)} logprobs")
    length = max(2, max(len(p) + len(r) for p, r, _ in sequences))
    b = len(sequences)
    input_ids = torch.full((b, length), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((b, length), dtype=torch.int64)
    response_mask = torch.zeros((b, length - 1), dtype=torch.float32)
    behaviour = torch.zeros((b, length - 1), dtype=torch.float32)
    for i, (prompt, response, blp) in enumerate(sequences):
        p, t = len(prompt), len(response)
        ids = np.concatenate([np.asarray(prompt), np.asarray(response)]).astype(np.int64)
        input_ids[i, : p + t] = torch.from_numpy(ids)
        attention_mask[i, : p + t] = 1
        response_mask[i, p - 1 : p - 1 + t] = 1.0
        behaviour[i, p - 1 : p - 1 + t] = torch.from_numpy(np.asarray(blp, dtype=np.float32))
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "behaviour_logprobs": behaviour,
    }
