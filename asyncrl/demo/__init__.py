"""The embedded demos, offline and on two CPU cores: procedural tasks and the model recipes that warm a
tiny Llama up on each (``configs/demo-cpu.yaml``, ``demo-calc.yaml``, ``demo-guess.yaml``).

* ``sort``: sort 4-6 letters; prompts, held-out split and the reward.
* ``calc``: arithmetic solved by calling a calculator tool (a two-turn tool episode).
* ``guess``: find a secret number from higher/lower replies (a gym-shaped Env, up to 4 turns).
* ``guess_agent``, ``calc_agent``: the two agentic tasks as plain OpenAI-API agents (``openai`` only, no
  asyncrl import; ``configs/demo-guess-agent.yaml``, ``demo-calc-agent.yaml``).
* ``latency``: the environment-latency setting both agentic tasks share (fixed or log-normal).
* ``shapes``: name the colour of the shape drawn in a 64x64 picture (records with images, drawn at build);
  ``vlm``: its recipe, a tiny Idefics3 with the byte tokenizer and a real processor (``configs/demo-shapes.yaml``).
* ``model``, ``warmup``: the recipes (byte tokenizer, tiny Llama, a short supervised warm-up);
  ``recipes``: building one once into the model cache.

May import: the core, asyncrl.episodes, asyncrl.generators.
"""
