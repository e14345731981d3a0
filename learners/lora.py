"""LoRA (``model.lora``) on the learner: the policy trains an adapter (``peft``) and publishes it alone
(``asyncrl.weights.lora``: the version format, and how a generator merges it).

An adapted linear layer computes ``W x + (alpha / r) B (A x)``: ``W`` frozen (the model at ``model.path``),
A (r, in) and B (out, r) trained, B zero at the start (version 0 is the base model). A version holds
``M.lora_A`` and ``M.lora_B`` for each adapted layer ``M`` (its HF module path, e.g.
``model.layers.0.self_attn.q_proj``). The export holds the merged model and, in ``adapter/``, the adapter
as peft saves it.

The learner runs its model in eval mode (pi must be the distribution the generators sampled), so there is
no LoRA dropout.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncrl.config import LoraConfig
from asyncrl.weights.lora import A, B, merge


def with_lora(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """``model`` (an HF causal LM) wrapped by peft with an adapter on every ``lora.targets`` layer; only
    the adapter's parameters train."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.targets), lora_dropout=0.0)
    return get_peft_model(model, config)


def base_model(module: nn.Module) -> nn.Module:
    """The HF model inside a peft wrapper (``module`` itself when it is none)."""
    get = getattr(module, "get_base_model", None)
    return get() if callable(get) else module


def _adapted(module: nn.Module) -> dict[str, nn.Module]:
    """Each adapted layer of the peft-wrapped ``module`` by its HF module path."""
    from peft.tuners.lora import LoraLayer

    inner = base_model(module)
    return {name: m for name, m in inner.named_modules() if isinstance(m, LoraLayer)}


def adapter_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A version's tensors: ``M.lora_A`` and ``M.lora_B`` of each adapted layer ``M`` (CPU copies)."""
    out = {}
    for name, layer in _adapted(module).items():
        (key,) = layer.lora_A.keys()  # the one adapter, "default"
        out[name + A] = layer.lora_A[key].weight.detach().to("cpu", copy=True)
        out[name + B] = layer.lora_B[key].weight.detach().to("cpu", copy=True)
    return out


def merged_state(module: nn.Module, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The HF state dict of the model with the adapter merged in (for the export): every weight (each
    tied one once), each adapted one ``W + (alpha / r) B A``."""
    from asyncrl.weights.ties import module_aliases

    inner = base_model(module)
    aliases = module_aliases(inner)
    state = {}
    for key, value in inner.state_dict().items():
        name = key.replace(".base_layer.", ".")
        if ".lora_" not in key and name not in aliases:
            state[name] = value.detach().to("cpu", copy=True)
    state.update(merge(state, adapter_state(module), lora.alpha / lora.rank))
    return state
