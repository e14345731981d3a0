"""The inference-engine boundary: one interface, a vLLM and a transformers implementation.

Invariant: ``logprobs[t]`` of a completion is the log-probability of ``tokens[t]`` under the
distribution actually sampled (temperature applied), computed with the weights the engine served,
so the learner's importance ratios compare like with like.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from asyncrl.config import Config


@dataclasses.dataclass
class Completion:
    tokens: list[int]  # (T,) response token ids, EOS included when the model stopped
    logprobs: list[float]  # (T,) behaviour log-probs of the sampled tokens
    finish_reason: str  # "stop" | "length"


@dataclasses.dataclass(frozen=True)
class Sampling:
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int


class Engine(abc.ABC):
    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt; greedy when ``temperature`` is 0."""

    @abc.abstractmethod
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace every weight at once (HF names); called only between engine calls."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


def setup(cfg: Config, seed: int) -> Engine:
    if cfg.generator.engine == "vllm":
        from asyncrl.generators.vllm_engine import VllmEngine

        return VllmEngine(cfg, seed)
    from asyncrl.generators.hf_engine import HfEngine

    return HfEngine(cfg, seed)
