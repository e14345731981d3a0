"""Batching: padded batches and their token log-probabilities, and the registry lookup and masked mean
that every algorithm piece shares.

``make_batch`` turns a learner rank's trajectory groups into one step's padded tensors (``pad_batch``) with
their rewards (the DAPO overlong penalty added), group ids and a vision-language policy's image inputs.

Alignment convention (``pad_batch`` and ``sequence_logprobs``): position ``j`` of every ``(B, L-1)``
tensor describes the token at ``input_ids[:, j + 1]`` predicted from the prefix ``input_ids[:, :j+1]``.
The losses themselves are composed from the registries in ``advantages``, ``policy_losses``, ``kl``
and ``corrections`` by ``objective.step_loss``.

Memory (``model_logprobs``): a model's sampled-token log-probs never materialise the (B, L, V) logits
nor their log-softmax. The LM head runs on chunks of positions, each under ``torch.utils.checkpoint``,
so backward keeps only the final hidden states and recomputes one chunk's logits at a time; the
values and gradients are the whole-batch ones (``tests/learners/test_learner_memory.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from asyncrl.learners.advantages import overlong_penalty
from asyncrl.models.route_replay import batch_routes

if TYPE_CHECKING:
    from asyncrl.config.presets import Preset
    from asyncrl.learners.vision import BatchImages  # vision -> models -> batching: a type only
    from asyncrl.protocol import TrajectoryGroup

__all__ = ["make_batch", "masked_mean", "model_logprobs", "pad_batch", "sequence_logprobs", "token_logprobs"]


def masked_mean(x: Tensor, mask: Tensor, count: float) -> float:
    """sum(x * mask) / count as a float (a metric, no gradient); 0.0 when ``count`` is 0."""
    return float((x * mask).sum()) / count if count > 0 else 0.0


# ----------------------------------------------------------------------------- token log-probs


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """log softmax(logits / temperature)[targets]: (..., V), (...) -> (...).

    Computed in at least float32 (bf16 logits are upcast; float64 stays float64). The temperature must
    be the generator's sampling temperature, or pi and mu describe different distributions and the
    importance weights are biased.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    return torch.gather(logp, dim=-1, index=targets.long().unsqueeze(-1)).squeeze(-1)


def sequence_logprobs(logits: Tensor, input_ids: Tensor, temperature: float) -> Tensor:
    """log softmax(logits[:, j] / temperature)[input_ids[:, j + 1]] for j < L-1. (B, L, V) -> (B, L-1).

    ``token_logprobs`` of whole-batch logits: materialises (B, L-1, V) float32 twice (tempered logits and
    their log-softmax, kept for backward). A model's log-probs come from ``model_logprobs``, which does not.
    """
    return token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)


# The LM head's chunk: about this many bytes of float32 logits at a time. Backward holds a few
# chunk-sized buffers (the recomputed logits, their log-softmax, its gradient), so 32 MiB bounds the
# transient near 130 MB whatever the vocabulary (SmolLM2's 49152: 170 positions a chunk); a smaller chunk
# gains little memory (the (V, H) weight gradient, 113 MB there, is the floor) and costs calls.
CHUNK_BYTES = 32 << 20

# Model types whose causal-LM forward is exactly ``lm_head(get_decoder()(...).last_hidden_state)``
# (transformers 5.x; checked in each modeling file). Others score through the full logits, as their
# heads post-process them (Gemma 2/3 soft-capping, Cohere's logit_scale, Granite's logits_scaling, ...).
PLAIN_HEAD_MODELS = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "olmo", "olmo2", "smollm3"}
)


def model_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    temperature: float,
    score_mask: Tensor | None = None,
    chunk: int | None = None,
    position_ids: Tensor | None = None,
    inputs: dict[str, Tensor] | None = None,
) -> Tensor:
    """(B, L-1) log pi of ``input_ids[:, j + 1]`` given its prefix, from ``model``: an HF causal LM or a
    DeepSpeed engine around one. Only positions in ``score_mask`` (B, L-1) are scored (default: every
    position whose next token is not padding; the learner passes its response mask); the others are 0.

    With a plain head (``PLAIN_HEAD_MODELS``), the decoder's final hidden states at the scored positions
    go through the head ``chunk`` rows at a time (default: ``CHUNK_BYTES`` of logits), each chunk under
    ``torch.utils.checkpoint`` when gradients are on. Both happen inside the model's own forward call
    (a forward hook replaces its output), so a DeepSpeed engine sees the log-probs as the forward's
    output -- its backward prologue runs before any parameter gradient -- and ZeRO-3 gathers the head's
    weight as it does for any call of the head module. Other models go through their full logits.
    ``position_ids`` (B, L): for left-padded batches (default: the model's own, 0..L-1). ``inputs``: more
    keyword inputs of the forward, a row per sequence (a vision-language model's pixels).
    """
    hf = getattr(model, "module", model)  # a DeepSpeed engine's HF model
    scored = attention_mask[:, 1:].bool() if score_mask is None else score_mask.bool()
    decoder, head = _plain_head(hf)
    positions = ({} if position_ids is None else {"position_ids": position_ids}) | (inputs or {})
    if decoder is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, **positions).logits
        return sequence_logprobs(logits, input_ids, temperature).masked_fill(~scored, 0.0)
    if chunk is None:
        chunk = max(1, CHUNK_BYTES // (4 * hf.config.vocab_size))
    captured: list[Tensor] = []

    def keep_hidden(_module, _args, output) -> None:
        captured.append(output[0])  # last_hidden_state: what the head reads

    def score(_module, _args, _output) -> Tensor:
        hidden = captured.pop()[:, :-1][scored]  # (N, H)
        logprobs = chunked_logprobs(head, hidden, input_ids[:, 1:][scored], temperature, chunk)
        return logprobs.new_zeros(scored.shape).masked_scatter(scored, logprobs)

    with decoder.register_forward_hook(keep_hidden), hf.register_forward_hook(score):
        # logits_to_keep=1: the forward's own head call scores one position, and its output is replaced
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1, **positions)


def chunked_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float, chunk: int) -> Tensor:
    """``token_logprobs(head(hidden), targets)`` for hidden (N, H), targets (N,), ``chunk`` rows at a time;
    with gradients on, each chunk is recomputed in backward instead of keeping its logits (a head marked by
    ``add_head_grad_in_place``: by :class:`_HeadLogprobs`)."""

    def one(h: Tensor, t: Tensor) -> Tensor:
        return token_logprobs(head(h), t, temperature)

    grad = torch.is_grad_enabled()
    in_place = grad and getattr(head, IN_PLACE_GRAD, False) and head.weight.requires_grad
    pairs = zip(hidden.split(chunk), targets.split(chunk), strict=True)
    if in_place:
        parts = [_HeadLogprobs.apply(h, t, head, temperature) for h, t in pairs]
    else:
        parts = [checkpoint(one, h, t, use_reentrant=False) if grad else one(h, t) for h, t in pairs]
    return torch.cat(parts) if parts else hidden.new_zeros(0)


IN_PLACE_GRAD = "asyncrl_grad_in_place"  # a head's marker: its weight's gradient is added in place


def add_head_grad_in_place(model: nn.Module) -> bool:
    """Mark ``model``'s LM head (a bias-free ``nn.Linear``) so that scoring it with gradients adds each
    chunk's weight gradient into ``weight.grad`` in place (:class:`_HeadLogprobs`) instead of handing
    autograd a (V, H) gradient per chunk to sum: 113 MB less on SmolLM2-135M, early in backward. Only where
    nothing hooks the weight's gradient as autograd accumulates it (the learner: ZeRO 0 in float32).
    Returns whether the head was marked."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return False
    setattr(head, IN_PLACE_GRAD, True)
    return True


class _HeadLogprobs(torch.autograd.Function):
    """``token_logprobs(head(h), t, temperature)`` for one chunk, whose backward recomputes the logits and
    adds the weight's gradient into ``weight.grad`` in place. The head module is passed as a plain object:
    its weight is not an autograd input, ``h`` (which requires grad) makes autograd call this backward."""

    @staticmethod
    def forward(ctx, h: Tensor, t: Tensor, head: nn.Linear, temperature: float) -> Tensor:
        ctx.save_for_backward(h, t)
        ctx.head, ctx.temperature = head, temperature
        with torch.no_grad():
            return token_logprobs(h @ head.weight.detach().T, t, temperature)

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, t = ctx.saved_tensors
        weight, temperature = ctx.head.weight, ctx.temperature
        dtype = torch.promote_types(weight.dtype, torch.float32)
        # d log softmax(z)[t] / dz = onehot(t) - softmax(z), z = logits / temperature
        dz = torch.softmax((h @ weight.detach().T).to(dtype) / temperature, dim=-1)
        g = grad.to(dtype)[:, None]
        dz.mul_(-g).scatter_add_(-1, t.long()[:, None], g).div_(temperature)
        dz = dz.to(weight.dtype)
        if weight.grad is None:
            weight.grad = dz.T @ h
        else:
            weight.grad.addmm_(dz.T, h)
        return dz @ weight.detach(), None, None, None


def _plain_head(hf: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(decoder, head) when ``hf``'s logits are exactly ``head(decoder(...)[0])``, else (None, None)."""
    from asyncrl.learners.lora import base_model

    inner = base_model(hf)  # a LoRA policy's HF model: peft's wrapper passes the keywords through
    config = getattr(inner, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_MODELS:
        return None, None
    if "logits_to_keep" not in inspect.signature(inner.forward).parameters:
        return None, None
    decoder, head = inner.get_decoder(), inner.get_output_embeddings()
    if not isinstance(decoder, nn.Module) or not isinstance(head, nn.Module):
        return None, None
    return decoder, head


def pad_batch(sequences: Sequence[tuple], pad_id: int) -> dict[str, Tensor]:
    """Right-pad (prompt_ids (P,), response_ids (T,), behaviour_logprobs (T,)[, model_mask (T,)]) into
    tensors.

    Returns ``input_ids`` (B, L) int64 = prompt ++ response ++ pad, ``attention_mask`` (B, L) int64,
    and, aligned with ``sequence_logprobs`` output (position j predicts token j + 1):
    ``response_mask`` (B, L-1) float32, at j = P-1 .. P+T-2 (the next token is response token
    j - P + 1) the token's model mask (1.0 without one; 0.0 for environment tokens, which are context
    only: no gradient, no count), 0.0 elsewhere; and ``behaviour_logprobs`` (B, L-1) float32 with
    behaviour_logprobs[P - 1 + t] = mu_t on model tokens and 0 elsewhere. Each prompt needs P >= 1
    (the first response token is predicted from it). Right padding keeps default position ids
    (0..len-1) correct for causal LMs.
    """
    if not sequences:
        raise ValueError("pad_batch needs at least one sequence")
    for i, (prompt, response, blp, *mask) in enumerate(sequences):
        if len(prompt) < 1:
            raise ValueError(f"sequence {i}: empty prompt (the first response token needs a context)")
        if len(response) != len(blp):
            raise ValueError(f"sequence {i}: {len(response)} response tokens but {len(blp)} logprobs")
        if mask and len(mask[0]) != len(response):
            raise ValueError(f"sequence {i}: {len(response)} response tokens but a mask of {len(mask[0])}")
    length = max(2, max(len(seq[0]) + len(seq[1]) for seq in sequences))
    b = len(sequences)
    input_ids = torch.full((b, length), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((b, length), dtype=torch.int64)
    response_mask = torch.zeros((b, length - 1), dtype=torch.float32)
    behaviour = torch.zeros((b, length - 1), dtype=torch.float32)
    for i, (prompt, response, blp, *mask) in enumerate(sequences):
        p, t = len(prompt), len(response)
        model = np.asarray(mask[0], dtype=np.float32) if mask else np.ones(t, dtype=np.float32)
        ids = np.concatenate([np.asarray(prompt), np.asarray(response)]).astype(np.int64)
        input_ids[i, : p + t] = torch.from_numpy(ids)
        attention_mask[i, : p + t] = 1
        response_mask[i, p - 1 : p - 1 + t] = torch.from_numpy(model)
        behaviour[i, p - 1 : p - 1 + t] = torch.from_numpy(np.asarray(blp, dtype=np.float32) * model)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "behaviour_logprobs": behaviour,
    }


def make_batch(
    groups: list[TrajectoryGroup],
    max_len: int,
    preset: Preset,
    pad_id: int,
    version: int,
    images: BatchImages | None = None,
) -> dict:
    """Padded tensors of this rank's groups: ids, masks, behaviour log-probs, rewards, group ids, and a
    vision-language policy's image inputs (``images``).

    ``max_len`` is the generation limit (``generator.max_new_tokens``): the DAPO overlong penalty's scale.
    """
    seqs = [(g.prompt_ids, s.tokens, s.logprobs, s.mask) for g in groups for s in g.samples]
    batch = pad_batch(seqs, pad_id)
    # 1.0 where a response token was produced by the version this learner holds (for the mismatch metric)
    same = torch.zeros_like(batch["response_mask"])
    rows = [(len(g.prompt_ids), s.versions) for g in groups for s in g.samples]
    for i, (p, versions) in enumerate(rows):
        same[i, p - 1 : p - 1 + len(versions)] = torch.from_numpy((versions == version).astype(np.float32))
    batch["same_version"] = same
    rewards = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float64)
    lengths = torch.tensor([int(s.mask.sum()) for g in groups for s in g.samples])  # model tokens
    shaping = overlong_penalty(lengths, max_len, preset.overlong_buffer, preset.overlong_penalty)
    batch["rewards"] = (rewards + shaping).to(torch.float32)
    batch["group_ids"] = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
    if given := [s.routes for g in groups for s in g.samples if s.routes is not None]:  # rollout routing replay
        routes = [s.routes for g in groups for s in g.samples]
        lengths = [len(g.prompt_ids) + len(s.tokens) for g in groups for s in g.samples]
        batch["routes"] = batch_routes(routes, lengths, batch["input_ids"].shape[1], *given[0].shape[1:])
    if any(s.turn_rewards is not None for g in groups for s in g.samples):  # multi-turn episodes
        turns = torch.zeros_like(batch["response_mask"])
        rows = [(len(g.prompt_ids), s.turn_rewards) for g in groups for s in g.samples]
        for i, (p, rewards) in enumerate(rows):
            if rewards is not None:
                turns[i, p - 1 : p - 1 + len(rewards)] = torch.from_numpy(rewards.astype(np.float32))
        batch["turn_rewards"] = turns
    return batch | (images.inputs(groups) if images is not None else {})
