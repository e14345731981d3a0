"""Generators: claim prompts, sample groups with an inference engine, score them, push to the buffer.

Installed as ``asyncrl.generators``. Engines (vLLM, transformers) are imported lazily by
:func:`asyncrl.generators.engine.setup`. ``worker`` is the process; ``scheduler`` pumps the engine for every
episode in flight; ``evaluation`` decides which version evaluates each eval point (the first served at or
after it); ``accounting`` counts episodes and holds the failure limit; ``lease`` keeps the fleet lease between
ticks; ``outcomes`` turns an episode into its wire sample; ``weight_feed`` applies new versions; ``prompts``
turns a record into what the engine and the learner each take (a vision-language model's images).

May import: the core, asyncrl.buffers, asyncrl.weights, asyncrl.observe, asyncrl.episodes,
asyncrl.rewards, asyncrl.models.
"""
