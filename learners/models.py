"""The extra models a preset may need next to the policy: a frozen reference and a critic.

* Reference (``preset.uses_kl``): a frozen copy of the INITIAL policy (``model.path``), no optimizer,
  forward under ``no_grad``. A restart reloads it from ``model.path``, so it never drifts.
* Critic (``preset.needs_critic``: GAE or V-trace): a value head on a copy of the base model, trained
  by its own DeepSpeed engine and optimizer. Checkpointed with the policy
  (``deepspeed_engine.save_checkpoint``), never published to generators.

Memory: neither scores through the full (B, L, V) logits (``batching.model_logprobs``); with
``learner.activation_checkpointing`` the policy and the critic's base recompute each decoder layer in
backward (``peak_memory.enable_activation_checkpointing``, which ``deepspeed_engine.build_engine``
applies) instead of keeping its activations.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from asyncrl.config import LearnerConfig, ModelConfig

__all__ = ["ValueModel", "build_critic", "load_reference", "reference_logprobs"]


class ValueModel(nn.Module):
    """V(s_j) = head(h_j): the base model's last hidden state at position j, i.e. the value of the
    state before token j + 1 -- aligned with ``loss.sequence_logprobs`` (B, L) -> (B, L-1)."""

    def __init__(self, base: nn.Module, hidden_size: int):
        super().__init__()
        self.base = base
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # V = 0 at start: the first advantages are the plain returns
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(hidden[:, :-1]).squeeze(-1).float()


def build_critic(learner: LearnerConfig, model_cfg: ModelConfig, steps: int, lr: float | None):
    """A DeepSpeed engine around ``ValueModel`` on a fresh copy of ``model.path``'s base model
    (``lr`` None: the policy's)."""
    from transformers import AutoModel

    from asyncrl.learners.deepspeed_engine import build_engine

    base = AutoModel.from_pretrained(model_cfg.path, dtype=getattr(torch, model_cfg.dtype))
    model = ValueModel(base, base.config.hidden_size).to(getattr(torch, model_cfg.dtype))
    return build_engine(learner, model_cfg, steps, model=model, lr=lr)


def load_reference(model_cfg: ModelConfig, device) -> nn.Module:
    from asyncrl.models.vision import causal_lm_class

    ref = causal_lm_class(model_cfg.path).from_pretrained(model_cfg.path, dtype=getattr(torch, model_cfg.dtype))
    return ref.to(device).eval().requires_grad_(False)


@torch.no_grad()
def reference_logprobs(ref: nn.Module, batch: dict, temperature: float) -> Tensor:
    from asyncrl.learners.batching import model_logprobs

    ids, mask, scored = batch["input_ids"], batch["attention_mask"], batch.get("response_mask")
    return model_logprobs(ref, ids, mask, temperature, scored, inputs=image_inputs(batch))  # 0 outside the response


IMAGE_PREFIX = "image/"  # a batch's image inputs (learners.vision), under "image/<the forward's keyword>"


def image_inputs(batch: dict) -> dict[str, Tensor]:
    """The forward's image keywords of ``batch`` (none for text)."""
    return {k.removeprefix(IMAGE_PREFIX): v for k, v in batch.items() if k.startswith(IMAGE_PREFIX)}
