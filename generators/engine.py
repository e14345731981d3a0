"""The inference-engine boundary: one interface, a vLLM and a transformers implementation.

Invariant: ``logprobs[t]`` of a completion is the log-probability of ``tokens[t]`` under the
distribution actually sampled (temperature applied), computed with the weights of version
``versions[t]``, so the learner's importance ratios compare like with like, token by token.

Weights that arrive while an engine generates (``generator.engine.on_weight_update``):

* ``wait``: the caller uses ``generate`` and applies them after the call (every completion is one
  version);
* ``continue`` (``generate_updating``, vllm only): the engine asks the generator's ``WeightFeed``
  between its steps and applies what it gets; every unfinished request goes on from the tokens it
  has, its KV cache recomputed under the new weights, so later tokens carry the new version and
  their log-probs are exactly the new policy's;
* ``abort`` (likewise): every unfinished request starts again from its prompt.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from asyncrl.config import HfEngineConfig, ModelConfig, VllmEngineConfig
    from asyncrl.generators.weight_feed import WeightFeed


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


OnUpdate = Literal["continue", "abort"]  # on_weight_update other than wait


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
    def generate(self, prompts: list[list[int]], sampling: Sampling, version: int = 0) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt, all of weights ``version`` (the one served);
        greedy when ``temperature`` is 0."""

    def generate_updating(
        self, prompts: list[list[int]], sampling: Sampling, feed: WeightFeed, on_update: OnUpdate
    ) -> list[list[Completion]]:
        """Like ``generate`` from ``feed.version``, but asks ``feed`` for newer weights between engine
        steps and applies them as ``on_update`` says (see the module doc)."""
        raise NotImplementedError(f"{type(self).__name__} applies weights only between calls")

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
