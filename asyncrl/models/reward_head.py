"""A reward model's head and the batches it scores: what ``asyncrl rm`` trains (``asyncrl.offline``, its loss in
``learners.offline_losses``) and what a run's ``rm:<dir>`` reward loads (``asyncrl.rewards.model``).

A batch is ``pad_pairs``' padded (prompt, response) sequences, padded on either side: position ids count real
tokens only, so a left-padded sequence scores as it would alone. ``RewardModel``: r is a scalar head on the
final hidden state of the sequence's last real token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


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
