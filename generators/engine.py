"""The inference-engine boundary: one interface, a vLLM and a transformers implementation.

Invariant: ``logprobs[t]`` of a completion is the log-probability of ``tokens[t]`` under the
distribution actually sampled (temperature applied), computed with the weights of version
``versions[t]``, so the learner's importance ratios compare like with like, token by token.

Engines are driven through requests (``add_request`` / ``step`` / ``abort_requests``), continuously,
by the generator's episode scheduler (``asyncrl.generators.scheduler``): a turn is added when its
episode asks for it, and each ``step`` returns the new tokens of every running request. An engine with
``multi_sample`` also takes one request of ``sampling.n`` samples of a prompt (a single-turn group:
the prompt's prefill shared); each sample is then reported under the request's id with its ``index``. Only the
scheduler's one engine thread calls ``step``; requests are added, aborted and weights loaded only
between steps.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING

from asyncrl.errors import UserError

if TYPE_CHECKING:
    import numpy as np
    import torch

    from asyncrl.config import GeneratorConfig, HfEngineConfig, ModelConfig, VllmEngineConfig


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one turn is sampled. With ``top_k``, ``top_p`` or ``min_p`` the behaviour log-probs are of the
    truncated, renormalised distribution actually sampled (what both engines report)."""

    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()  # besides EOS: tokens that end a turn (a chat template's)
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    stop: tuple[str, ...] = ()  # strings that end a turn; the turn's last token completes one
    # a turn whose log-probs nobody reads (the default single turn's evaluations, which hold the weights): none
    # (NaN), and where the engine can, its tokens when it ends, not step by step (~10% of such an evaluation's
    # engine CPU on vLLM)
    tokens_only: bool = False


def turn_sampling(
    generator: GeneratorConfig, stop_token_ids: tuple[int, ...], greedy: bool = False, tokens_only: bool = False
) -> Sampling:
    """The run's sampling for one turn (``greedy``: the evaluations', temperature 0, no truncation)."""
    g = generator
    if greedy:
        return Sampling(1, 0.0, 1.0, g.max_new_tokens, stop_token_ids, stop=tuple(g.stop), tokens_only=tokens_only)
    return Sampling(1, g.temperature, g.top_p, g.max_new_tokens, stop_token_ids, g.top_k, g.min_p, tuple(g.stop))


@dataclasses.dataclass
class StepOutput:
    """What one ``step`` produced for one request: its new tokens, and whether it is done."""

    request_id: str
    tokens: list[int]  # new token ids since the last step
    logprobs: list[float]  # their behaviour log-probs
    finished: bool  # this sample is done (the request is once each of its samples is)
    finish_reason: str = "length"  # "stop" | "length", when finished
    index: int = 0  # which of the request's ``sampling.n`` samples (0 for a single one)
    # when finished, with rollout routing replay: the (positions, layers, top_k) uint8 experts each position of
    # prompt and sample was routed to (every position a forward ran: all but the last token's)
    routes: np.ndarray | None = None


def context_length(model_path: str, max_model_len: int | None = None) -> int:
    """The engines' context in tokens: ``max_model_len`` if given, else the model's
    (``max_position_embeddings``); a prompt plus its completion must fit in it. Raises ``UserError`` for a
    ``max_model_len`` beyond the model's."""
    from transformers import AutoConfig

    # a vision-language model's context is its language model's
    model = int(AutoConfig.from_pretrained(model_path).get_text_config().max_position_embeddings)
    if max_model_len is None:
        return model
    if max_model_len > model:
        raise UserError(f"generator.max_model_len={max_model_len} is more than the model's context of {model} tokens")
    return max_model_len


KV_BLOCK_TOKENS = 256  # a sequence's KV is held in whole blocks: none of vLLM's CPU attention backends' is larger


def cpu_kv_cache_bytes(model: ModelConfig, max_num_seqs: int, max_model_len: int, engine: VllmEngineConfig) -> int:
    """vLLM's KV cache on CPU for one generator: room for ``max_num_seqs`` sequences of ``max_model_len`` tokens
    at once, each in whole blocks (and one more, vLLM's null block), at most ``engine.kv_cache_gb``. Given the
    ceiling alone, vLLM takes all of it and faults every page in as it starts: the demo's model fills 100 MB of
    its 1 GiB, and the other 0.9 GiB cost ~0.5 CPU-s at each engine start (262k page faults, 2 GiB of memory
    on a 2-generator run). A model whose cache per token cannot be read off its config (layers that are not
    attention, such as state-space or linear-attention ones) gets the ceiling."""
    ceiling = engine.kv_cache_gb << 30
    per_token = kv_bytes_per_token(model.path, model.dtype)
    if per_token is None:
        return ceiling
    blocks = -(-max_model_len // KV_BLOCK_TOKENS)
    return min(ceiling, (max_num_seqs + 1) * blocks * KV_BLOCK_TOKENS * per_token)


def kv_bytes_per_token(model_path: str, dtype: str) -> int | None:
    """Keys and values of one token over every layer (heads x head size x 2, in ``dtype``), or None where the
    model's language config has layers other than attention, or does not say its heads."""
    import torch
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model_path).get_text_config()
    layer_types = set(getattr(text, "layer_types", None) or ())
    if layer_types - {"full_attention", "sliding_attention"} or any("mamba" in k or "ssm" in k for k in vars(text)):
        return None
    layers, heads, hidden = (
        getattr(text, k, None) for k in ("num_hidden_layers", "num_attention_heads", "hidden_size")
    )
    if not (layers and heads and hidden):
        return None
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    return layers * 2 * kv_heads * head_dim * getattr(torch, dtype).itemsize


def fits(prompt_len: int, max_new_tokens: int, max_model_len: int) -> bool:
    """Whether a prompt of ``prompt_len`` tokens leaves room for a full completion."""
    return prompt_len + max_new_tokens <= max_model_len


class Engine(abc.ABC):
    max_model_len: int  # tokens of prompt plus completion one sequence may hold
    multi_sample: bool = False  # add_request takes sampling.n > 1 (else the scheduler adds n requests)
    scores_alongside: bool = False  # start_score: the probe is scored in the next step, with the requests
    probe_routing: list | None = None  # a mixture of experts: the expert choices of the last score() (per layer,
    # per token, sorted), compared with the learner's (asyncrl.observe.probe.compare)

    @abc.abstractmethod
    def add_request(self, request_id: str, prompt: list[int], sampling: Sampling, images: tuple = ()) -> None:
        """Start ``sampling.n`` independent completions of ``prompt`` (more than one only where
        ``multi_sample``); their tokens come from ``step``, each sample's under its ``index``. ``images``: a
        vision-language model's RGB PIL images, one image token each in ``prompt``, which the engine expands."""

    @abc.abstractmethod
    def step(self) -> list[StepOutput]:
        """Advance every running request; blocking. Each sample of a request appears once with finished
        (the samples of one request may finish at different steps)."""

    @abc.abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop these requests, every sample of each (unknown or finished ids are ignored); they produce
        no more output."""

    def score(self, ids: list[int]) -> list[float]:
        """Log-probs of ``ids[1:]`` under the served weights at temperature 1 (the weight-sync probe,
        ``asyncrl.observe.probe``); called only between steps, with no request running."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a sequence")

    def start_score(self, ids: list[int]) -> None:
        """``score(ids)`` as a request of the next ``step``, alongside the running ones (where
        ``scores_alongside``): its log-probs come from ``take_score`` after that step. ``abort_score`` drops it."""
        raise NotImplementedError(f"{type(self).__name__} cannot score alongside requests")

    def take_score(self) -> list[float] | None:
        """The log-probs of the sequence ``start_score`` gave, once a step scored it (then None again)."""
        return None

    def abort_score(self) -> bool:
        """Drop a score started and not taken yet; returns whether there was one."""
        return False

    def bind_thread(self) -> None:  # noqa: B027 - optional hook
        """Called once on the thread that will run ``step`` (the scheduler's engine thread)."""

    @abc.abstractmethod
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace every weight at once (HF names); called only between engine calls or steps."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


def preload_modules(engine: VllmEngineConfig | HfEngineConfig, gpu: bool) -> list[str]:
    """What a generator imports before its engine serves, for a fork server to import once
    (``asyncrl.run.forkserver``): nothing that starts a thread or touches a GPU when imported. With GPUs, torch
    and transformers only: vLLM resolves its platform (NVML) as it imports, which a forked child must do itself
    (not yet measured on a GPU). On CPU, vLLM with its CPU worker and attention (0.7 CPU-s more than ``vllm``)."""
    if gpu:
        return ["asyncrl.generators.worker"]
    if engine.type != "vllm":
        return ["asyncrl.generators.worker", "asyncrl.generators.hf_engine"]
    return [
        "asyncrl.generators.worker",
        "asyncrl.generators.vllm_engine",
        "vllm.entrypoints.llm",
        "vllm.v1.worker.cpu_worker",
        "vllm.v1.attention.backends.cpu_attn",
    ]
