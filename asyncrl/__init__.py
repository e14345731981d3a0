"""asyncrl: asynchronous RL for language models.

Heavy dependencies (vllm, deepspeed, torch) are imported only inside generators, learners and the
launcher's children, so ``import asyncrl`` and ``asyncrl --help`` stay fast.
"""

__version__ = "0.1.0"
