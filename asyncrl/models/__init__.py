"""Model recipes a config names (``model.recipe``) and model files the run converts.

* ``gguf``: a ``.gguf`` file as an HF model directory, converted once and cached.
* ``reward_head``: a reward model's scalar head and its padded (prompt, response) batches: what ``asyncrl rm``
  trains and an ``rm:`` reward scores with.
* ``routers``: a mixture of experts' routers as the learner and the transformers engine see them (expert
  choices of real tokens, load balance, the auxiliary loss), found by shape in any family.
* ``smollm2``: SmolLM2-135M-Instruct offline (its tokenizer for tests, the ``smollm2-135m-instruct`` recipe).
* ``vision``: vision-language models: the class that loads one, its language model's weights (what a frozen
  tower leaves to train and publish), its processor's image-token expansion and pixel inputs.

The demos' tiny models are recipes too, in ``asyncrl.demo``.

May import: the core.
"""
