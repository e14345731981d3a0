"""Generators: claim prompts, sample groups with an inference engine, score them, push to the buffer.

Installed as ``asyncrl.generators``. Engines (vLLM, transformers) are imported lazily by
:func:`asyncrl.generators.engine.setup`.

May import: the core, asyncrl.buffers, asyncrl.weights, asyncrl.observe, asyncrl.episodes,
asyncrl.rewards.
"""
