"""What keeps a learner rank's peak memory down, applied to the policy (and a critic's base) by
``deepspeed_engine.build_engine``; each leaves values and gradients as they were
(``tests/learners/test_learner_memory.py``).

* ``enable_activation_checkpointing`` (``learner.activation_checkpointing``): every decoder layer recomputes its
  activations in backward instead of keeping them; ``by_rows``, a few sequences at a time
  (``recompute_by_rows``).
* ``accumulate_tied_lookup_in_place``: a tied input embedding adds its gradient rows into the shared weight's
  gradient in place.

The in-place ones only where nothing hooks gradients as autograd accumulates them (ZeRO 0 in float32: the
engine's ``plain_grads``). Here, not in ``models``, because ``models`` builds its critic through
``deepspeed_engine``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

__all__ = [
    "RECOMPUTE_TOKENS",
    "accumulate_tied_lookup_in_place",
    "enable_activation_checkpointing",
    "recompute_by_rows",
]


def enable_activation_checkpointing(model: nn.Module, by_rows: bool = False) -> None:
    """HF gradient checkpointing (non-reentrant) of every decoder layer of the HF model in ``model``
    (the policy, or a critic's base): backward recomputes a layer's activations from its input.
    ``by_rows``: each layer is recomputed and differentiated a few sequences at a time
    (:class:`_RowsRecompute`; only where nothing hooks the gradients as autograd accumulates them).

    The model stays in eval mode, as the learner always runs it (no dropout: pi must be the
    distribution the generators sampled); only the checkpointed layers are flagged as training, the
    flag HF's checkpointing checks, so values and gradients are those without checkpointing.
    """
    from transformers import PreTrainedModel

    from asyncrl.errors import UserError

    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if hf is None or not hf.supports_gradient_checkpointing:
        name = type(hf or model).__name__
        raise UserError(f"{name} does not support gradient checkpointing; set learner.activation_checkpointing=false")
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in hf.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if not layers:
        raise UserError(f"{type(hf).__name__} has no checkpointable layers; set learner.activation_checkpointing=false")
    for layer in layers:
        layer.training = True  # this module only (not .train(): its children stay in eval mode)
        if by_rows:
            layer._gradient_checkpointing_func = partial(recompute_by_rows, layer._gradient_checkpointing_func)


# Sequences of a batch recomputed at once in a checkpointed layer's backward (``recompute_by_rows``): this
# many tokens' worth. SmolLM2-135M, 32 sequences of 62 tokens, ZeRO 0 f32, with the head's gradient added
# in place: 256 tokens 2.65 GB, 512 2.67 GB at 3% less step time, the whole batch (before both changes)
# 2.74-2.76 GB (scripts/bench/memory.py --config configs/smollm2-arith.yaml --checkpointing on, alternated).
RECOMPUTE_TOKENS = 256
# a decoder layer's keyword inputs with one row per sequence (or one broadcast row); any other tensor input
# makes the layer take the whole-batch recompute
_ROW_INPUTS = frozenset({"attention_mask", "position_embeddings", "position_ids"})


def recompute_by_rows(checkpoint: Callable, layer_call: partial, hidden: Tensor, *args):
    """A decoder layer's call under HF checkpointing (``checkpoint(layer_call, hidden, *args)``), its
    backward recomputing and differentiating ``RECOMPUTE_TOKENS`` at a time, sequence by sequence: the
    layer's activations are those of a few sequences, not the batch's, at the end of backward, when every
    gradient exists (the learner's peak). Whole-batch where that cannot be done or gains nothing."""
    rows = max(1, RECOMPUTE_TOKENS // max(1, hidden.shape[1]))
    batch = hidden.shape[0]
    inputs = layer_call.keywords
    per_row = all(k in _ROW_INPUTS or not _has_tensor(v) for k, v in inputs.items())
    if args or not per_row or rows >= batch or not (torch.is_grad_enabled() and hidden.requires_grad):
        return checkpoint(layer_call, hidden, *args)
    return _RowsRecompute.apply(hidden, layer_call, rows)


def _has_tensor(value) -> bool:
    return isinstance(value, Tensor) or (isinstance(value, tuple) and any(isinstance(v, Tensor) for v in value))


def _rows_of(value, rows: slice, batch: int):
    """``value``'s rows ``rows`` where it has one per sequence (a broadcast row, or no tensor, as it is)."""
    if isinstance(value, tuple):
        return tuple(_rows_of(v, rows, batch) for v in value)
    if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == batch:
        return value[rows]
    return value


class _RowsRecompute(torch.autograd.Function):
    """A layer run without a graph on the whole batch; in backward, recomputed and differentiated a few
    sequences (rows) at a time: the parameters' gradients accumulate into ``.grad`` row block by row block
    (in place after the first, as a reentrant checkpoint does), the input's gradient is put together from
    the blocks. Exact: a decoder layer treats each sequence on its own (attention stays within a row)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, layer_call: partial, rows: int) -> Tensor:
        ctx.save_for_backward(hidden)
        ctx.layer_call, ctx.rows = layer_call, rows
        with torch.no_grad():
            out = layer_call(hidden)
        if not isinstance(out, Tensor):
            raise TypeError(f"a row-recomputed layer must return a tensor, not {type(out).__name__}")
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (hidden,) = ctx.saved_tensors
        call, batch = ctx.layer_call, hidden.shape[0]
        parts = []
        for start in range(0, batch, ctx.rows):
            rows = slice(start, start + ctx.rows)
            inputs = {k: _rows_of(v, rows, batch) for k, v in call.keywords.items()}
            block = hidden[rows].detach().requires_grad_(True)
            with torch.enable_grad():
                out = call.func(block, *call.args, **inputs)
            torch.autograd.backward(out, grad[rows])
            parts.append(block.grad)
        return torch.cat(parts), None, None


class _TiedLookup(torch.autograd.Function):
    """The input embedding's lookup of a weight tied to the output head, its gradient rows added in place
    into ``weight.grad`` rather than handed to autograd. Autograd would sum the weight's two gradients
    out of place: the head's full-vocabulary gradient, a dense one of the same size from the lookup and
    their sum, at the end of backward, when every other gradient exists too (the learner's peak). The
    head's gradient is in ``weight.grad`` by then: the head is the last op of the forward, so its
    backward comes first, and it is now the weight's only autograd use. ``anchor`` (a scalar that
    requires grad) makes autograd call this backward; the embedding module is passed as a plain object,
    so the weight is not an autograd input of the lookup."""

    @staticmethod
    def forward(ctx, ids: Tensor, anchor: Tensor, embedding: nn.Embedding) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.embedding = embedding
        return nn.functional.embedding(ids, embedding.weight.detach(), embedding.padding_idx)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (ids,) = ctx.saved_tensors
        embedding = ctx.embedding
        weight = embedding.weight
        rows = grad.reshape(-1, grad.shape[-1]).to(weight.dtype)
        if embedding.padding_idx is not None:  # nn.Embedding gives the padding row no gradient
            rows = rows.masked_fill((ids.reshape(-1) == embedding.padding_idx)[:, None], 0.0)
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, ids.reshape(-1), rows)
        return None, None, None


def accumulate_tied_lookup_in_place(model: nn.Module) -> bool:
    """Make a model whose input embedding is tied to its output head add the lookup's gradient into the
    shared weight's gradient in place (:class:`_TiedLookup`; one to two embeddings' worth of memory less
    at the end of backward, 0.11-0.23 GB on SmolLM2-135M in float32). Only where nothing hooks the
    weight's gradient as autograd accumulates it: DeepSpeed's ZeRO 1-3 and its bf16/fp16 optimizers do,
    so the learner asks for this at ZeRO 0 in float32 only. Returns whether the model was changed."""
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    outputs = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(inputs, nn.Embedding) or outputs is None or outputs.weight is not inputs.weight:
        return False
    if inputs.max_norm is not None or inputs.scale_grad_by_freq or inputs.sparse:
        return False  # their lookups are not a plain gather
    anchor = torch.zeros((), requires_grad=True)
    plain = inputs.forward

    def forward(ids: Tensor) -> Tensor:
        if not (torch.is_grad_enabled() and inputs.weight.requires_grad):
            return plain(ids)
        return _TiedLookup.apply(ids, anchor, inputs)

    inputs.forward = forward
    return True
