"""A mixture of experts' routers in the learner: which experts the tokens of a forward took, for each step's
metrics (how evenly the experts are loaded, the router's auxiliary loss) and, with
``learner.router_aux_loss_coef``, that loss added to the step's.

Routers are found by what they are, not by model family: a module with ``top_k`` and ``num_experts`` whose
forward returns (router logits, top-k weights, top-k expert ids), as transformers 5's ``*TopKRouter`` of
Qwen3-MoE, OLMoE and Mixtral do. A dense model has none, and a :class:`RouterTap` of it records nothing.

The tap pairs each forward's router outputs (one row per token of the flattened (B, L) batch) with that
forward's ``attention_mask``, taken by a pre-hook on the model, so padding counts for nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def find_routers(model: nn.Module) -> list[nn.Module]:
    hf = getattr(model, "module", model)  # a DeepSpeed engine's HF model
    return [m for m in hf.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts") and hasattr(m, "weight")]


class RouterTap:
    """Router logits and expert choices of the forwards run inside ``with tap:``, over real tokens only."""

    def __init__(self, model: nn.Module):
        self.routers = find_routers(model)
        self.active = False
        self.mask: Tensor | None = None
        self.logits: list[Tensor] = []  # per router call: (real tokens, experts), with gradient in training
        self.choices: list[Tensor] = []  # per router call: (real tokens, top_k) expert ids
        if not self.routers:
            return
        self.top_k, self.experts = int(self.routers[0].top_k), int(self.routers[0].num_experts)
        hf = getattr(model, "module", model)
        hf.register_forward_pre_hook(self._take_mask, with_kwargs=True)
        for router in self.routers:
            router.register_forward_hook(self._record)

    def __bool__(self) -> bool:
        return bool(self.routers)

    def __enter__(self) -> RouterTap:
        self.active, self.logits, self.choices = bool(self.routers), [], []
        return self

    def __exit__(self, *exc) -> None:
        self.active, self.mask = False, None

    def _take_mask(self, module, args, kwargs) -> None:
        if self.active:
            mask = kwargs.get("attention_mask")
            self.mask = mask.reshape(-1).bool() if mask is not None else None

    def _record(self, module, args, out) -> None:
        if not self.active:
            return
        logits, _, chosen = out
        keep = self.mask if self.mask is not None and self.mask.numel() == logits.shape[0] else slice(None)
        self.logits.append(logits[keep])
        self.choices.append(chosen[keep])

    def sums(self) -> dict[str, Tensor]:
        """Over every router call recorded: tokens per (layer, expert) choice, router probability mass per
        (layer, expert), and the token count per layer; sums, to add up over ranks before :func:`router_metrics`."""
        counts = torch.stack([torch.bincount(c.flatten(), minlength=self.experts).float() for c in self.choices])
        probs = torch.stack([torch.softmax(lg.detach().float(), -1).sum(0) for lg in self.logits])
        tokens = torch.tensor([float(lg.shape[0]) for lg in self.logits])
        return {"counts": counts.cpu(), "probs": probs.cpu(), "tokens": tokens}

    def aux_loss(self) -> Tensor:
        """The load-balancing loss of Switch Transformer as transformers computes it, with gradient: per layer,
        experts x sum over experts of (fraction of choices) x (mean router probability), averaged."""
        losses = []
        for logits, chosen in zip(self.logits, self.choices, strict=True):
            if logits.shape[0] == 0:
                continue
            share = torch.bincount(chosen.flatten(), minlength=self.experts).float() / chosen.numel()
            losses.append(self.experts * (share.to(logits.device) * torch.softmax(logits.float(), -1).mean(0)).sum())
        return torch.stack(losses).mean() if losses else torch.zeros(())


def router_metrics(counts: Tensor, probs: Tensor, tokens: Tensor, top_k: int) -> dict[str, float]:
    """``learner/moe_load_max`` and ``..._min``: the busiest and idlest expert's share of the choices over an
    even share (1.0 each: perfectly balanced), the worst layer's; ``learner/moe_aux_loss``: the load-balancing
    loss (1.0 when balanced), layers averaged; from :meth:`RouterTap.sums` added up over the ranks."""
    experts = counts.shape[1]
    share = counts / (tokens[:, None] * top_k).clamp(min=1)
    load = share * experts
    aux = experts * (share * probs / tokens[:, None].clamp(min=1)).sum(1)
    return {
        "learner/moe_load_max": float(load.max()),
        "learner/moe_load_min": float(load.min()),
        "learner/moe_aux_loss": float(aux.mean()),
    }


def add_aux_loss(tap: RouterTap, out, coef: float) -> None:
    """``coef`` x the auxiliary loss of the forward ``tap`` recorded, added to a step's ``StepLoss.policy_loss``
    (``learners.objective``; each rank its own tokens'). Nothing for a model without routers, or ``coef`` 0."""
    if tap and tap.logits and coef > 0:
        out.policy_loss = out.policy_loss + coef * tap.aux_loss()


def step_router_metrics(tap: RouterTap, reducer) -> dict[str, float]:
    """:func:`router_metrics` of the forward ``tap`` recorded, over every rank (``reducer.sum``, a collective);
    empty for a model without routers."""
    if not tap or not tap.logits:
        return {}
    sums = tap.sums()
    shapes = {k: v.shape for k, v in sums.items()}
    flat = reducer.sum(torch.cat([v.flatten() for v in sums.values()]).tolist())
    total, at = {}, 0
    for key, shape in shapes.items():
        size = shape.numel()
        total[key] = torch.tensor(flat[at : at + size]).reshape(shape)
        at += size
    return router_metrics(total["counts"], total["probs"], total["tokens"], tap.top_k)


def choices_of(tap: RouterTap) -> list[list[list[int]]] | None:
    """The expert choices of the forward ``tap`` last recorded: per router (layer), per token, the top-k
    expert ids sorted; None for a model without routers."""
    if not tap or not tap.choices:
        return None
    return [[sorted(row) for row in chosen.tolist()] for chosen in tap.choices]
