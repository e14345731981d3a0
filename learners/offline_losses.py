"""The offline training modes' batches and losses: supervised fine-tuning, a Bradley-Terry reward model
and DPO (``asyncrl sft``, ``asyncrl rm``, ``asyncrl dpo``; the loop is ``learners.offline``).

A batch is ``pad_pairs``' padded (prompt, response) sequences, padded on either side: position ids
count real tokens only, so a left-padded sequence scores as it would alone. Every loss is a sum over
this rank's examples divided by the count over all ranks (a ``Reducer`` sum) and multiplied by the
world size, because DeepSpeed averages gradients over ranks: one step over R ranks is then the step
over their union on one rank (``tests/offline/test_offline_losses.py``).

* SFT: the mean negative log-likelihood of the response tokens (token-mean over the whole batch).
* Reward model: ``-log sigmoid(r(chosen) - r(rejected))``, the pair's mean; r is a scalar head on the
  final hidden state of the sequence's last real token (``RewardModel``).
* DPO: h = (log pi(chosen) - log pi_ref(chosen)) - (log pi(rejected) - log pi_ref(rejected)) per pair;
  ``PAIR_LOSSES``: ``sigmoid`` (DPO: ``-log sigmoid(beta h)`` on summed log-probs) and ``ipo`` (IPO:
  ``(h - 1 / (2 beta))^2`` on per-token mean log-probs, as the IPO paper's length-normalised ratios).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asyncrl.config.pieces import lookup
from asyncrl.learners.batching import model_logprobs

__all__ = [
    "PAIR_LOSSES",
    "RewardModel",
    "bradley_terry_loss",
    "dpo_loss",
    "pad_pairs",
    "pair_logratio",
    "response_logprobs",
    "sft_loss",
]


def pad_pairs(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int, side: str = "right") -> dict:
    """(prompt_ids, response_ids) pairs into tensors: ``input_ids``, ``attention_mask`` and
    ``position_ids`` (B, L), and ``response_mask`` (B, L-1), 1 at position j when token j + 1 is a response
    token (the alignment of ``batching.pad_batch``). ``side``: where the padding goes."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be left or right, got {side!r}")
    if not sequences:
        raise ValueError("pad_pairs needs at least one sequence")
    length = max(2, max(len(p) + len(r) for p, r in sequences))
    b = len(sequences)
    input_ids = torch.full((b, length), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((b, length), dtype=torch.int64)
    response_mask = torch.zeros((b, length - 1), dtype=torch.float32)
    for i, (prompt, response) in enumerate(sequences):
        if len(prompt) < 1:
            raise ValueError(f"sequence {i}: empty prompt (the first response token needs a context)")
        p, t = len(prompt), len(response)
        start = 0 if side == "right" else length - p - t
        input_ids[i, start : start + p + t] = torch.tensor([*prompt, *response], dtype=torch.int64)
        attention_mask[i, start : start + p + t] = 1
        response_mask[i, start + p - 1 : start + p - 1 + t] = 1.0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
    }


def response_logprobs(model: nn.Module, batch: dict) -> Tensor:
    """(B, L-1) log pi of each response token (0 elsewhere), at temperature 1."""
    ids, mask, scored = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    return model_logprobs(model, ids, mask, 1.0, scored, position_ids=batch["position_ids"])


def sft_loss(logprobs: Tensor, response_mask: Tensor, total_tokens: float, world: int) -> Tensor:
    """This rank's part of the token-mean NLL over ``total_tokens`` response tokens on all ranks."""
    return -(logprobs * response_mask).sum() * (world / max(total_tokens, 1.0))


class RewardModel(nn.Module):
    """r(x) = head(h_last): a scalar on the base model's final hidden state at each sequence's last real
    token (left or right padding)."""

    def __init__(self, base: nn.Module, hidden_size: int):
        super().__init__()
        self.base = base
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # r = 0 at start: the first pairs' loss is log 2
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        out = self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state
        length = attention_mask.shape[1]
        last = length - 1 - attention_mask.flip(-1).argmax(-1)  # index of the last 1 in each row
        scores = self.head(hidden[torch.arange(hidden.shape[0]), last]).squeeze(-1)
        return scores.to(torch.promote_types(scores.dtype, torch.float32))  # bf16 scores upcast, float64 kept


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, total_pairs: float, world: int) -> Tensor:
    """This rank's part of the mean ``-log sigmoid(r_chosen - r_rejected)`` over ``total_pairs`` pairs."""
    return -F.logsigmoid(chosen - rejected).sum() * (world / max(total_pairs, 1.0))


def _sigmoid(h: Tensor, beta: float) -> Tensor:
    return -F.logsigmoid(beta * h)


def _ipo(h: Tensor, beta: float) -> Tensor:
    return (h - 1.0 / (2.0 * beta)) ** 2


# loss name -> (per-pair loss of h and beta, whether log-probs are per-token means)
PAIR_LOSSES: dict[str, tuple[Callable[[Tensor, float], Tensor], bool]] = {
    "sigmoid": (_sigmoid, False),
    "ipo": (_ipo, True),
}


def pair_logratio(logprobs: Tensor, response_mask: Tensor, mean: bool) -> Tensor:
    """(B,) each response's log-prob: the sum over its tokens, or their mean."""
    total = (logprobs * response_mask).sum(-1)
    return total / response_mask.sum(-1).clamp(min=1.0) if mean else total


def dpo_loss(
    name: str,
    beta: float,
    policy: tuple[Tensor, Tensor],
    reference: tuple[Tensor, Tensor],
    total_pairs: float,
    world: int,
) -> tuple[Tensor, Tensor]:
    """This rank's part of the mean pair loss ``name`` over ``total_pairs`` pairs, and each pair's h
    (detached; h > 0: the policy prefers the chosen response more than the reference does).
    ``policy``/``reference``: (chosen, rejected) response log-probs, each (N,), from ``pair_logratio``."""
    fn, _ = lookup(PAIR_LOSSES, "dpo loss", name)
    h = (policy[0] - reference[0]) - (policy[1] - reference[1])
    return fn(h, beta).sum() * (world / max(total_pairs, 1.0)), h.detach()
