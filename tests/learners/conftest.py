"""Fixtures the learner tests share."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def moe():
    """The demo's tiny Qwen3-MoE (2 layers of 8 experts, 2 a token), its routers made decisive, as a trained
    router's are."""
    from asyncrl.demo.model import build_moe_model, build_tokenizer
    from asyncrl.models.routers import find_routers

    model = build_moe_model(build_tokenizer(), seed=1)
    with torch.no_grad():
        for router in find_routers(model):
            router.weight.mul_(20)
    return model
