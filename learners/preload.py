"""What a CPU learner rank imports before it knows its rank, imported once by the launch's learner fork server
(``asyncrl.run.forkserver``), whose forked ranks then skip it: torch, transformers' causal-LM classes, DeepSpeed
and the learner's own modules (~5 of the ~6 CPU-seconds a rank spends before its first step on the demo).
Importing this module does it, as the rank itself would: without CUDA, triton hidden first
(:func:`~asyncrl.learners.deepspeed_engine.hide_triton_without_cuda`), DeepSpeed's accelerator the CPU. It starts no
thread and touches no GPU; on GPUs ranks are started, not forked (not measured there)."""

import os

from asyncrl.learners.deepspeed_engine import hide_triton_without_cuda

hide_triton_without_cuda()
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as init_distributed sets it before a rank imports DeepSpeed

import deepspeed  # noqa: E402, F401
import transformers.models.auto.modeling_auto  # noqa: E402, F401

import asyncrl.learners.trainer  # noqa: E402, F401
