"""Tied parameters (an LM head that is the input embedding) travel once.

A model whose parameters include one tensor under two names (``lm_head.weight`` and
``model.embed_tokens.weight`` with ``tie_word_embeddings``) publishes it once, under the output
head's name: a version's bytes are the model's unique parameter bytes. Learner rank 0 writes the
model's aliases to the run's metadata (``tied``) before its first version, and a generator re-ties
each version it applies (:func:`retied`: the one tensor under every name, no copy), so an engine
loads the state dict it expects. Without that, vLLM would load the head (its LM head module holds
the embedding's parameter, so both change) but warn that the embedding "failed to load".
"""

from __future__ import annotations

import torch


def module_aliases(module: torch.nn.Module) -> dict[str, str]:
    """``{alias: name}`` for every parameter of ``module`` known by more than one name, ``name`` being
    the published one: the output head's (``get_output_embeddings()``), else the first registered."""
    get_head = getattr(module, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    head_params = {id(p) for p in head.parameters()} if isinstance(head, torch.nn.Module) else set()
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    aliases = {}
    for pid, group in names.items():
        if len(group) > 1:
            keep = next((n for n in group if pid in head_params and _in_head(module, head, n)), group[0])
            aliases.update({n: keep for n in group if n != keep})
    return aliases


def _in_head(module: torch.nn.Module, head: torch.nn.Module, name: str) -> bool:
    prefix = name.rpartition(".")[0]
    return module.get_submodule(prefix) is head if prefix else module is head


def untied(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` without the aliases of :func:`module_aliases`."""
    aliases = module_aliases(module)
    return {k: v for k, v in module.state_dict().items() if k not in aliases}


def retied(tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """A received version with every alias back, each the same tensor as its published name."""
    return {**tensors, **{alias: tensors[name] for alias, name in aliases.items() if name in tensors}}
