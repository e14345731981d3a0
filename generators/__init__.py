"""Generators: claim prompts, sample groups with an inference engine, score them, push to the buffer.

Installed as ``asyncrl.generators``. ``engine`` is the engine interface; :func:`setup_engine` picks an
implementation and imports it lazily (vLLM, transformers), here rather than in ``engine``, which both
implementations import. ``worker`` is the process; ``scheduler`` pumps the engine for every episode in flight;
``evaluation`` decides which version evaluates each eval point (the first served at or after it); ``accounting``
counts episodes and holds the failure limit; ``lease`` keeps the fleet lease between ticks; ``outcomes`` turns
an episode into its wire sample; ``weight_feed`` applies new versions; ``prompts`` turns a record into what the
engine and the learner each take (a vision-language model's images).

May import: the core, asyncrl.buffers, asyncrl.weights, asyncrl.observe, asyncrl.service, asyncrl.episodes,
asyncrl.gateway, asyncrl.rewards, asyncrl.models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import HfEngineConfig, ModelConfig, VllmEngineConfig
    from asyncrl.generators.engine import Engine

__all__ = ["setup_engine"]


def setup_engine(
    engine: VllmEngineConfig | HfEngineConfig,
    model: ModelConfig,
    max_num_seqs: int,
    seed: int,
    max_model_len: int | None = None,
    routes: bool = False,
) -> Engine:
    """The engine ``engine.type`` names; ``max_num_seqs`` is the most sequences one call runs at once,
    ``max_model_len`` the context (None: the model's); ``routes``: samples carry their routed experts (a
    mixture of experts on vLLM: rollout routing replay)."""
    if engine.type == "vllm":
        from asyncrl.generators.vllm_engine import VllmEngine

        return VllmEngine(engine, model, max_num_seqs, seed, max_model_len=max_model_len, routes=routes)
    from asyncrl.generators.hf_engine import HfEngine

    return HfEngine(model, seed, max_model_len=max_model_len)
