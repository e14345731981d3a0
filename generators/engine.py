"""The inference-engine boundary: one interface, a vLLM and a transformers implementation.

Invariant: ``logprobs[t]`` of a completion is the log-probability of ``tokens[t]`` under the
distribution actually sampled (temperature applied), computed with the weights of version
``versions[t]``, so the learner's importance ratios compare like with like, token by token.

Weights that arrive during a ``generate`` call (``updates``, polled between engine steps) are
handled by ``on_update``:

* ``wait``: not polled; applied by the caller after the call (every completion is one version);
* ``continue``: applied between two steps; every unfinished request goes on from the tokens it has,
  its KV cache recomputed under the new weights, so later tokens carry the new version and their
  log-probs are exactly the new policy's;
* ``abort``: applied between two steps; every unfinished request starts again from its prompt.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Literal, Protocol

import torch

from asyncrl.config import Config


@dataclasses.dataclass
class Completion:
    tokens: list[int]  # (T,) response token ids, EOS included when the model stopped
    logprobs: list[float]  # (T,) behaviour log-probs of the sampled tokens
    finish_reason: str  # "stop" | "length"
    versions: list[int] = dataclasses.field(default_factory=list)  # (T,) version that produced each token


class WeightUpdates(Protocol):
    """Where an engine gets weights that arrive while it generates (the generator implements it)."""

    def poll(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """A version newer than the one served, and its tensors; None if there is none."""

    def applied(self, version: int, seconds: float) -> None:
        """The engine serves ``version`` now (it took ``seconds`` to apply)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int


OnUpdate = Literal["wait", "continue", "abort"]


class Engine(abc.ABC):
    supports_updates_in_flight = False  # can honour on_update = continue | abort

    @abc.abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        sampling: Sampling,
        version: int = 0,
        updates: WeightUpdates | None = None,
        on_update: OnUpdate = "wait",
    ) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt; greedy when ``temperature`` is 0. ``version`` is
        the version served at the start; see the module doc for ``updates`` and ``on_update``."""

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
