"""The inference-engine boundary: one interface, a vLLM and a transformers implementation.

Invariant: ``logprobs[t]`` of a completion is the log-probability of ``tokens[t]`` under the
distribution actually sampled (temperature applied), computed with the weights of version
``versions[t]``, so the learner's importance ratios compare like with like, token by token.

Engines are driven through requests (``add_request`` / ``step`` / ``abort_requests``), continuously,
by the generator's episode scheduler (``asyncrl.generators.scheduler``): a turn is added when its
episode asks for it, and each ``step`` returns the new tokens of every running request. Only the
scheduler's one engine thread calls ``step``; requests are added, aborted and weights loaded only
between steps.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from asyncrl.config import HfEngineConfig, ModelConfig, VllmEngineConfig


@dataclasses.dataclass
class Completion:
    tokens: list[int]  # (T,) response token ids, EOS included when the model stopped
    logprobs: list[float]  # (T,) behaviour log-probs of the sampled tokens
    finish_reason: str  # "stop" | "length"
    versions: list[int] = dataclasses.field(default_factory=list)  # (T,) version that produced each token


@dataclasses.dataclass(frozen=True)
class Sampling:
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()  # besides EOS: tokens that end a turn (a chat template's)


@dataclasses.dataclass
class StepOutput:
    """What one ``step`` produced for one request: its new tokens, and whether it is done."""

    request_id: str
    tokens: list[int]  # new token ids since the last step
    logprobs: list[float]  # their behaviour log-probs
    finished: bool
    finish_reason: str = "length"  # "stop" | "length", when finished


def context_length(model_path: str) -> int:
    """The model's context in tokens (``max_position_embeddings``): a prompt plus its completion must
    fit in it."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_path).max_position_embeddings)


def fits(prompt_len: int, max_new_tokens: int, max_model_len: int) -> bool:
    """Whether a prompt of ``prompt_len`` tokens leaves room for a full completion."""
    return prompt_len + max_new_tokens <= max_model_len


class Engine(abc.ABC):
    max_model_len: int  # tokens of prompt plus completion one sequence may hold

    @abc.abstractmethod
    def add_request(self, request_id: str, prompt: list[int], sampling: Sampling) -> None:
        """Start one completion (``sampling.n`` is 1) of ``prompt``; its tokens come from ``step``."""

    @abc.abstractmethod
    def step(self) -> list[StepOutput]:
        """Advance every running request; blocking. Each finished request appears once with finished."""

    @abc.abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop these requests (unknown or finished ids are ignored); they produce no more output."""

    def bind_thread(self) -> None:  # noqa: B027 - optional hook
        """Called once on the thread that will run ``step`` (the scheduler's engine thread)."""

    @abc.abstractmethod
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace every weight at once (HF names); called only between engine calls or steps."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


def setup(engine: VllmEngineConfig | HfEngineConfig, model: ModelConfig, max_num_seqs: int, seed: int) -> Engine:
    """The engine ``engine.type`` names; ``max_num_seqs`` is the most sequences one call runs at once."""
    if engine.type == "vllm":
        from asyncrl.generators.vllm_engine import VllmEngine

        return VllmEngine(engine, model, max_num_seqs, seed)
    from asyncrl.generators.hf_engine import HfEngine

    return HfEngine(model, seed)
