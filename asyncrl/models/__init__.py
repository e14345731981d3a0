"""Model recipes a config names (``model.recipe``) and model files the run converts.

* ``gguf``: a ``.gguf`` file as an HF model directory, converted once and cached.
* ``routers``: a mixture of experts' routers as the learner and the transformers engine see them (expert
  choices of real tokens, load balance, the auxiliary loss), found by shape in any family.
* ``smollm2``: SmolLM2-135M-Instruct offline (its tokenizer for tests, the ``smollm2-135m-instruct`` recipe).

The demos' tiny models are recipes too, in ``asyncrl.demo``.

May import: the core.
"""
