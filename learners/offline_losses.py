"""The offline training modes' batches and losses: supervised fine-tuning, a Bradley-Terry reward model
and DPO (``asyncrl sft``, ``asyncrl rm``, ``asyncrl dpo``; the loop is ``learners.offline``).

A batch is ``pad_pairs``' padded (prompt, response) sequences, padded on either side: position ids
count real tokens only, so a left-padded sequence scores as it would alone (``pad_pairs`` and the reward
model's head ``RewardModel`` live in ``asyncrl.models.reward_head``, where the ``rm:`` reward loads them
too). Every loss is a sum over this rank's examples divided by the count over all ranks (a ``Reducer``
sum) and multiplied by the world size, because DeepSpeed averages gradients over ranks: one step over R
ranks is then the step over their union on one rank (``tests/offline/test_offline_losses.py``).

* SFT: the mean negative log-likelihood of the response tokens (token-mean over the whole batch).
* Reward model: ``-log sigmoid(r(chosen) - r(rejected))``, the pair's mean; r is a scalar head on the
  final hidden state of the sequence's last real token (``RewardModel``).
* DPO: h = (log pi(chosen) - log pi_ref(chosen)) - (log pi(rejected) - log pi_ref(rejected)) per pair;
  ``PAIR_LOSSES``: ``sigmoid`` (DPO: ``-log sigmoid(beta h)`` on summed log-probs) and ``ipo`` (IPO:
  ``(h - 1 / (2 beta))^2`` on per-token mean log-probs, as the IPO paper's length-normalised ratios).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from asyncrl.config.pieces import lookup
from asyncrl.learners.batching import model_logprobs

__all__ = [
    "PAIR_LOSSES",
    "bradley_terry_loss",
    "dpo_loss",
    "pair_logratio",
    "response_logprobs",
    "sft_loss",
]


def response_logprobs(model: nn.Module, batch: dict) -> Tensor:
    """(B, L-1) log pi of each response token (0 elsewhere), at temperature 1."""
    ids, mask, scored = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    return model_logprobs(model, ids, mask, 1.0, scored, position_ids=batch["position_ids"])


def sft_loss(logprobs: Tensor, response_mask: Tensor, total_tokens: float, world: int) -> Tensor:
    """This rank's part of the token-mean NLL over ``total_tokens`` response tokens on all ranks."""
    return -(logprobs * response_mask).sum() * (world / max(total_tokens, 1.0))


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
