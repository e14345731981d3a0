"""Rollout routing replay (R3; Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers"), the learner's half: a mixture of experts' forward routes each token to the experts the
engine routed it to when it sampled (``Sample.routes``, recorded by ``generators.vllm_routes``), instead of its
own top-k, so the engine's and the learner's log-probs come from the same experts.

The choice of experts is replayed, not the gates: each token's gate weights are the learner's router
probabilities of the replayed experts, renormalised as the router renormalises its own top-k
(``norm_topk_prob``; Mixtral's always), so the policy gradient still reaches the router's weights through the
gates, as the R3 paper, verl and slime do. A position the engine gave no routes for (the sample's last token,
whose forward feeds no log-prob; padding; a sample without routes) keeps the learner's own routing.

Routers are found as :mod:`asyncrl.models.routers` finds them; the replay hook runs before any other hook on
them, so the router metrics and the auxiliary loss see the experts the forward used.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from asyncrl.models.routers import find_routers


class RouteReplay:
    """Inside ``with replay.using(routes):`` the routers of ``model`` take the experts ``routes`` gives."""

    def __init__(self, model: nn.Module):
        self.routers = find_routers(model)
        self._layer = {id(router): i for i, router in enumerate(self.routers)}
        self._routes: Tensor | None = None
        # token-layers replayed, and of those, where the learner's own top-k differs (0-d tensors once counted)
        self.given: Tensor | int = 0
        self.differ: Tensor | int = 0
        for router in self.routers:
            router.register_forward_hook(self._replay, prepend=True)

    def __bool__(self) -> bool:
        return bool(self.routers)

    @contextlib.contextmanager
    def using(self, routes: Tensor):
        """``routes``: (tokens of the flattened (B, L) batch, layers, top_k) expert ids, -1 where the learner
        keeps its own routing. The counts start again at each use."""
        if routes.shape[1] != len(self.routers):
            raise ValueError(f"routes for {routes.shape[1]} layers, but the model has {len(self.routers)} routers")
        self._routes, self.given, self.differ = routes, 0, 0
        try:
            yield self
        finally:
            self._routes = None

    def _replay(self, module: nn.Module, args, out):
        if self._routes is None:
            return None
        logits, scores, chosen = out
        given = self._routes[:, self._layer[id(module)]].to(chosen.device)
        if given.shape != chosen.shape:
            raise ValueError(f"routes of shape {tuple(given.shape)} for a router that chose {tuple(chosen.shape)}")
        known = (given >= 0).all(-1, keepdim=True)
        experts = torch.where(known, given, chosen)
        same = (experts.sort(-1).values == chosen.sort(-1).values).all(-1, keepdim=True)
        # counts kept on the model's device, read once a step (replay_metrics), not synchronised per layer; a
        # checkpointed layer's recompute counts again: both, so the share holds
        self.given = self.given + known.sum()
        self.differ = self.differ + (known & ~same).sum()
        gates = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
        if getattr(module, "norm_topk_prob", True):
            gates = gates / gates.sum(-1, keepdim=True)
        return logits, torch.where(known, gates.to(scores.dtype), scores), experts


def batch_routes(per_sample: list, lengths: list[int], width: int, layers: int, top_k: int) -> Tensor:
    """(B, ``width``, layers, top_k) int64 of each sample's (positions, layers, top_k) routes (or None) at its
    first positions, -1 elsewhere; ``lengths``: each sample's prompt and tokens, which its routes never exceed."""
    out = torch.full((len(per_sample), width, layers, top_k), -1, dtype=torch.int64)
    for i, (routes, length) in enumerate(zip(per_sample, lengths, strict=True)):
        if routes is None:
            continue
        if routes.shape[0] > length or routes.shape[1:] != (layers, top_k):
            raise ValueError(f"sample {i}: routes {routes.shape} for {length} positions of {layers} x {top_k}")
        out[i, : routes.shape[0]] = torch.from_numpy(routes.astype("int64"))
    return out
