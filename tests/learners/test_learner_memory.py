"""The learner's lean scoring (learners.batching.model_logprobs: the LM head in checkpointed chunks, never
the whole (B, L, V) logits) and activation checkpointing give the same log-probs and the same gradients
as the plain whole-batch computation; memory and speed are measured by scripts/bench/memory.py."""

from __future__ import annotations

import pytest
import torch

from asyncrl.errors import UserError
from asyncrl.learners.batching import (
    IN_PLACE_GRAD,
    add_head_grad_in_place,
    model_logprobs,
    pad_batch,
    sequence_logprobs,
)
from asyncrl.learners.peak_memory import accumulate_tied_lookup_in_place, enable_activation_checkpointing

VOCAB = 97
TEMPERATURE = 0.7


def llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, tie_word_embeddings=tie, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float().eval()


def ragged_batch() -> dict[str, torch.Tensor]:
    """Three sequences of different prompt and response lengths (right padding), one with an environment
    token (model mask 0) inside its response."""
    g = torch.Generator().manual_seed(1)
    seqs = []
    for p, t in ((3, 9), (7, 4), (1, 12)):
        ids = torch.randint(1, VOCAB, (p + t,), generator=g).tolist()
        mask = [1.0] * t
        if t == 12:
            mask[5] = 0.0
        seqs.append((ids[:p], ids[p:], [-1.0] * t, mask))
    return pad_batch(seqs, pad_id=0)


def reference(model, batch) -> torch.Tensor:
    """The plain computation: the model's full logits, their log-softmax, masked to the response."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return sequence_logprobs(logits, batch["input_ids"], TEMPERATURE) * batch["response_mask"]


def grads_of(model, logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    (logprobs * torch.linspace(-1.0, 2.0, logprobs.shape[-1])).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, None])  # None: the default (all positions in one chunk here)
def test_chunked_logprobs_and_gradients_equal_the_full_logits_ones(tie, chunk):
    model, batch = llama(tie), ragged_batch()
    expected = reference(model, batch)
    expected_grads = grads_of(model, expected)
    got = model_logprobs(model, batch["input_ids"], batch["attention_mask"], TEMPERATURE, batch["response_mask"], chunk)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (got[batch["response_mask"] == 0] == 0).all()  # prompt, padding and environment tokens: 0
    got_grads = grads_of(model, got)
    assert got_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_without_gradients_nothing_is_checkpointed_and_the_values_hold():
    model, batch = llama(tie=True), ragged_batch()
    with torch.no_grad():
        expected = reference(model, batch)
        got = model_logprobs(model, batch["input_ids"], batch["attention_mask"], TEMPERATURE, batch["response_mask"], 4)
    assert not got.requires_grad
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_activation_checkpointing_keeps_values_gradients_and_eval_mode():
    batch = ragged_batch()
    plain = llama(tie=True)
    expected = model_logprobs(plain, batch["input_ids"], batch["attention_mask"], TEMPERATURE, batch["response_mask"])
    expected_grads = grads_of(plain, expected)
    model = llama(tie=True)
    enable_activation_checkpointing(model)
    # no dropout (pi must be what the generators sampled): only the modules that checkpoint carry the
    # training flag HF's checkpointing reads, their attention and MLP stay in eval mode
    assert all(layer.training for layer in model.model.layers)
    assert {m for m in model.modules() if m.training} == {model.model, *model.model.layers}
    assert all(m.gradient_checkpointing for m in model.modules() if m.training)
    got = model_logprobs(model, batch["input_ids"], batch["attention_mask"], TEMPERATURE, batch["response_mask"])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    for name, grad in grads_of(model, got).items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("positions", [False, True])  # True: per-row position ids (left-padded offline batches)
def test_recomputing_by_rows_keeps_values_and_gradients(monkeypatch, positions):
    """``by_rows``: each layer's backward recomputes one sequence at a time here (its masks, rotary
    embeddings and position ids cut to the row); the same log-probs, and gradients over two backward
    passes, with the tied lookup added in place too (the learner's ZeRO 0 float32 set-up)."""
    import asyncrl.learners.peak_memory as peak_memory

    monkeypatch.setattr(peak_memory, "RECOMPUTE_TOKENS", 1)  # one row at a time
    batch = ragged_batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    extra = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)} if positions else {}
    args = (ids, mask, TEMPERATURE, batch["response_mask"])
    plain = llama(tie=True)
    expected = model_logprobs(plain, *args, **extra)
    expected_grads = grads_of(plain, expected)
    model = llama(tie=True)
    enable_activation_checkpointing(model, by_rows=True)
    accumulate_tied_lookup_in_place(model)
    calls = []
    monkeypatch.setattr(peak_memory._RowsRecompute, "apply", lambda *a: calls.append(a[2]) or orig_apply(*a))
    got = model_logprobs(model, *args, **extra)
    assert calls == [1, 1]  # both layers, a row at a time
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    got_grads = grads_of(model, got)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    (model_logprobs(model, *args, **extra) * torch.linspace(-1.0, 2.0, got.shape[-1])).sum().backward()
    for name, p in model.named_parameters():  # a second backward accumulates onto the first
        torch.testing.assert_close(p.grad, 2 * expected_grads[name], rtol=1e-5, atol=2e-6, msg=name)


orig_apply = __import__("asyncrl.learners.peak_memory", fromlist=["_RowsRecompute"])._RowsRecompute.apply


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("chunk", [1, 5])
def test_the_head_gradient_added_in_place_keeps_values_and_gradients(tie, chunk):
    """``add_head_grad_in_place``: each chunk's head gradient goes into ``weight.grad`` in place; the same
    log-probs and gradients (over two backward passes), alone and with every other ZeRO 0 float32 change
    (the tied lookup in place, rows recomputed); without gradients, the plain head."""
    batch = ragged_batch()
    args = (batch["input_ids"], batch["attention_mask"], TEMPERATURE, batch["response_mask"], chunk)
    plain = llama(tie)
    expected = model_logprobs(plain, *args)
    expected_grads = grads_of(plain, expected)
    for changes in ("head", "all"):
        model = llama(tie)
        assert add_head_grad_in_place(model)
        if changes == "all":
            enable_activation_checkpointing(model, by_rows=True)
            assert accumulate_tied_lookup_in_place(model) == tie
        got = model_logprobs(model, *args)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        got_grads = grads_of(model, got)
        assert got_grads.keys() == expected_grads.keys()
        for name, grad in expected_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=f"{changes}: {name}")
        (model_logprobs(model, *args) * torch.linspace(-1.0, 2.0, got.shape[-1])).sum().backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, 2 * expected_grads[name], rtol=1e-5, atol=2e-6, msg=f"{changes}: {name}")
        with torch.no_grad():
            torch.testing.assert_close(model_logprobs(model, *args), expected.detach(), rtol=0, atol=1e-6)


def test_a_model_without_gradient_checkpointing_is_a_clear_error():
    with pytest.raises(UserError, match="activation_checkpointing=false"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


def test_a_head_that_post_processes_its_logits_is_scored_through_them():
    """Models outside PLAIN_HEAD_MODELS (soft-capped or scaled logits) take the full-logits path, still
    masked to the response."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, final_logit_softcapping=5.0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model, batch = Gemma2ForCausalLM(config).float().eval(), ragged_batch()
    got = model_logprobs(model, batch["input_ids"], batch["attention_mask"], TEMPERATURE, batch["response_mask"], 2)
    torch.testing.assert_close(got, reference(model, batch), rtol=0, atol=1e-5)


def test_a_cpu_learner_never_imports_triton_and_its_model_still_trains():
    """learners.deepspeed_engine.hide_triton_without_cuda (96 MB of a CPU learner's memory): in a fresh process the
    model import, a forward and a backward run and triton was never loaded."""
    import subprocess
    import sys

    code = """
import sys, torch
from asyncrl.learners.deepspeed_engine import hide_triton_without_cuda
hide_triton_without_cuda()
from transformers import LlamaConfig, LlamaForCausalLM
import torch.utils._triton as t
model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=1, num_key_value_heads=1, head_dim=32))
model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
assert model.lm_head.weight.grad is not None
print(sys.modules.get("triton", "absent"), t.has_triton_package())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["None", "False"]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_tied_lookup_added_in_place_keeps_values_and_gradients(checkpointing):
    """``accumulate_tied_lookup_in_place``: the same log-probs, and the same gradients over two backward
    passes (mini-batches accumulate); the padding row (pad_id 0 is the model's padding_idx) gets none."""
    batch = ragged_batch()
    args = (batch["input_ids"], batch["attention_mask"], TEMPERATURE, batch["response_mask"])
    plain = llama(tie=True)
    expected = model_logprobs(plain, *args)
    expected_grads = grads_of(plain, expected)
    model = llama(tie=True)
    if checkpointing:
        enable_activation_checkpointing(model)
    assert accumulate_tied_lookup_in_place(model)
    got = model_logprobs(model, *args)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    got_grads = grads_of(model, got)
    assert got_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    weight = model.get_input_embeddings().weight
    (model_logprobs(model, *args) * torch.linspace(-1.0, 2.0, got.shape[-1])).sum().backward()  # a second one
    torch.testing.assert_close(weight.grad, 2 * expected_grads["model.embed_tokens.weight"], rtol=1e-5, atol=1e-7)
    with torch.no_grad():  # scoring without gradients takes the plain lookup
        torch.testing.assert_close(model_logprobs(model, *args), expected.detach(), rtol=0, atol=0)
    assert not accumulate_tied_lookup_in_place(llama(tie=False))  # nothing shared: nothing to change


def _tied_rank(rank: int) -> None:
    """Rank ``rank`` of 2 scores its own row of the ragged batch through a ZeRO 0 float32 engine (which
    adds the tied lookup's gradient in place); the gradients after DeepSpeed's all-reduce must be the mean
    of both rows' gradients in a plain model."""
    import os

    os.environ.update(LOCAL_RANK="0")
    from asyncrl.config import load_config
    from asyncrl.learners.deepspeed_engine import build_engine

    cfg = load_config(None, {"learner.zero_stage": 0, "model.dtype": "float32"})
    batch = ragged_batch()

    def loss_of(model, row: int) -> torch.Tensor:
        rows = {k: v[row : row + 1] for k, v in batch.items()}
        lp = model_logprobs(model, rows["input_ids"], rows["attention_mask"], TEMPERATURE, rows["response_mask"])
        return (lp * torch.linspace(-1.0, 2.0, lp.shape[-1])).sum()

    engine = build_engine(cfg.learner, cfg.model, 10, model=llama(tie=True))
    assert "forward" in vars(engine.module.get_input_embeddings())  # the in-place lookup is on
    assert getattr(engine.module.get_output_embeddings(), IN_PLACE_GRAD)  # and the in-place head
    engine.backward(loss_of(engine.module, rank))
    plain = llama(tie=True)
    (0.5 * (loss_of(plain, 0) + loss_of(plain, 1))).backward()
    got = dict(engine.module.named_parameters())
    for name, p in plain.named_parameters():  # float32 rounding of sums in another order: ~1e-6 on |grad| ~8
        torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-5, atol=2e-6, msg=name)


@pytest.mark.slow
def test_the_tied_lookup_in_place_survives_deepspeeds_all_reduce_over_two_ranks():
    pytest.importorskip("deepspeed")
    from gloo_ranks import run_on_ranks

    run_on_ranks(_tied_rank, 2)
