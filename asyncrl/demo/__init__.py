"""The embedded demo, offline and on two CPU cores: a procedural task and the model recipe that
warms a tiny Llama up on it (``configs/demo-cpu.yaml``).

* ``sort``: sort 4-6 letters; prompts, held-out split and the reward.
* ``model``: the ``demo-sort`` recipe (byte tokenizer, tiny Llama, a short supervised warm-up).
"""
