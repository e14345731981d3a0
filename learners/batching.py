"""Batching: padded batches and their token log-probabilities, and the registry lookup and masked mean
that every algorithm piece shares.

Alignment convention (``pad_batch`` and ``sequence_logprobs``): position ``j`` of every ``(B, L-1)``
tensor describes the token at ``input_ids[:, j + 1]`` predicted from the prefix ``input_ids[:, :j+1]``.
The losses themselves are composed from the registries in ``advantages``, ``policy_losses``, ``kl``
and ``corrections`` by ``objective.step_loss``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from asyncrl.errors import UserError

__all__ = ["lookup", "masked_mean", "pad_batch", "sequence_logprobs"]


def lookup(registry: dict, kind: str, name: str) -> Callable:
    """``registry[name]``; a UserError naming the ``kind`` and listing the known names if absent."""
    try:
        return registry[name]
    except KeyError:
        raise UserError(f"unknown {kind} {name!r}; known: {', '.join(sorted(registry))}") from None


def masked_mean(x: Tensor, mask: Tensor, count: float) -> float:
    """sum(x * mask) / count as a float (a metric, no gradient); 0.0 when ``count`` is 0."""
    return float((x * mask).sum()) / count if count > 0 else 0.0


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


def pad_batch(sequences: Sequence[tuple], pad_id: int) -> dict[str, Tensor]:
    """Right-pad (prompt_ids (P,), response_ids (T,), behaviour_logprobs (T,)[, model_mask (T,)]) into
    tensors.

    Returns ``input_ids`` (B, L) int64 = prompt ++ response ++ pad, ``attention_mask`` (B, L) int64,
    and, aligned with ``sequence_logprobs`` output (position j predicts token j + 1):
    ``response_mask`` (B, L-1) float32, at j = P-1 .. P+T-2 (the next token is response token
    j - P + 1) the token's model mask (1.0 without one; 0.0 for environment tokens, which are context
    only: no gradient, no count), 0.0 elsewhere; and ``behaviour_logprobs`` (B, L-1) float32 with
    behaviour_logprobs[P - 1 + t] = mu_t on model tokens and 0 elsewhere. Each prompt needs P >= 1
    (the first response token is predicted from it). Right padding keeps default position ids
    (0..len-1) correct for causal LMs.
    """
    if not sequences:
        raise ValueError("pad_batch needs at least one sequence")
    for i, (prompt, response, blp, *mask) in enumerate(sequences):
        if len(prompt) < 1:
            raise ValueError(f"sequence {i}: empty prompt (the first response token needs a context)")
        if len(response) != len(blp):
            raise ValueError(f"sequence {i}: {len(response)} response tokens but {len(blp)} logprobs")
        if mask and len(mask[0]) != len(response):
            raise ValueError(f"sequence {i}: {len(response)} response tokens but a mask of {len(mask[0])}")
    length = max(2, max(len(seq[0]) + len(seq[1]) for seq in sequences))
    b = len(sequences)
    input_ids = torch.full((b, length), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((b, length), dtype=torch.int64)
    response_mask = torch.zeros((b, length - 1), dtype=torch.float32)
    behaviour = torch.zeros((b, length - 1), dtype=torch.float32)
    for i, (prompt, response, blp, *mask) in enumerate(sequences):
        p, t = len(prompt), len(response)
        model = np.asarray(mask[0], dtype=np.float32) if mask else np.ones(t, dtype=np.float32)
        ids = np.concatenate([np.asarray(prompt), np.asarray(response)]).astype(np.int64)
        input_ids[i, : p + t] = torch.from_numpy(ids)
        attention_mask[i, : p + t] = 1
        response_mask[i, p - 1 : p - 1 + t] = torch.from_numpy(model)
        behaviour[i, p - 1 : p - 1 + t] = torch.from_numpy(np.asarray(blp, dtype=np.float32) * model)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "behaviour_logprobs": behaviour,
    }
