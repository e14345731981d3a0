"""LoRA (``model.lora``): the learner's adapter versions (learners.lora), their merge on a generator
(asyncrl.weights.lora, generators.weight_feed), and a demo run that trains one end to end."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from demo_launch import ROOT, demo_launch_cmd

from asyncrl.config import LoraConfig, load_config
from asyncrl.generators.weight_feed import WeightFeed
from asyncrl.learners.lora import adapter_state, merged_state, with_lora
from asyncrl.weights.lora import A, B, is_adapter, merge
from asyncrl.weights.wire import WeightUpdate, state_dict_checksum

LORA = LoraConfig(rank=4, alpha=8.0)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def trained_adapter():
    """A peft-wrapped tiny model whose adapter moved off its zero start."""
    model = with_lora(tiny_llama(), LORA)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)
    return model


IDS = torch.tensor([[1, 5, 7, 9, 2, 11]])


def test_only_the_adapter_trains_and_a_version_is_its_tensors_alone():
    model = trained_adapter()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    state = adapter_state(model)
    assert is_adapter(state) and len(state) == 2 * 4 * 2  # A and B of q, k, v, o in 2 layers
    assert state["model.layers.0.self_attn.q_proj" + A].shape == (4, 32)
    assert state["model.layers.0.self_attn.q_proj" + B].shape == (32, 4)
    full = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    assert sum(v.numel() for v in state.values()) < full / 10
    assert not is_adapter({"model.norm.weight": torch.ones(2)}) and not is_adapter({})


def test_the_merged_model_scores_as_the_adapted_one():
    model = trained_adapter()
    with torch.no_grad():
        want = model(input_ids=IDS).logits
        plain = tiny_llama()
        plain.load_state_dict(merged_state(model, LORA), strict=False)  # the tied head comes with its embedding
        assert torch.allclose(plain(input_ids=IDS).logits, want, atol=1e-5)
        assert not torch.allclose(tiny_llama()(input_ids=IDS).logits, want, atol=1e-3)  # the adapter matters


def test_a_generator_merges_adapter_versions_into_its_base_weights(tmp_path):
    """WeightFeed.engine_tensors: the base weights read from model.path, each adapted one merged; loaded
    into the HF engine, the model scores as the learner's adapted one (log-probs to 1e-5)."""
    from asyncrl.demo.model import build_tokenizer
    from asyncrl.generators.hf_engine import HfEngine

    base = tiny_llama()
    base.save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    model = trained_adapter()
    tensors = adapter_state(model)
    update = WeightUpdate(3, tensors, state_dict_checksum(tensors), sum(t.nbytes for t in tensors.values()), 0.0)
    aliases = {"lm_head.weight": "model.embed_tokens.weight"}
    feed = WeightFeed(None, None, None, aliases=aliases, adapter=(str(tmp_path), LORA.alpha / LORA.rank))
    engine = HfEngine(load_config(None, {"model.path": str(tmp_path), "model.recipe": None}).model, seed=0)
    engine.load_weights(feed.engine_tensors(update))
    with torch.no_grad():
        want = torch.log_softmax(model(input_ids=IDS).logits[0, :-1], -1).gather(-1, IDS[0, 1:, None])[:, 0]
    assert torch.allclose(torch.tensor(engine.score(IDS[0].tolist())), want, atol=1e-5)
    plain = WeightFeed(None, None, None)
    with pytest.raises(ValueError, match="no model.lora"):
        plain.engine_tensors(update)
    with pytest.raises(ValueError, match="no weight for"):
        merge({}, tensors, 1.0)


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.vllm
def test_a_lora_run_publishes_adapters_that_the_generators_apply_exactly(tmp_path):
    sets = {"run.steps": 3, "run.eval_every": 0, "model.lora.rank": 8, "learner.lr": 2e-3}
    args = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    cmd = demo_launch_cmd(tmp_path, "lora", "--generators", "1", "--learners", "1", *args)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "lora/metrics.jsonl").read_text().splitlines()]
    applied = [m for m in metrics if "weights/apply_seconds" in m]
    assert {m["generator/version"] for m in applied} >= {1, 2, 3}
    from safetensors.torch import load_file

    adapter = load_file(tmp_path / "lora/export/adapter/adapter_model.safetensors")
    assert all(m["weights/bytes"] == sum(t.nbytes for t in adapter.values()) for m in applied)  # the adapter only
    diffs = [m["weights/probe_logprob_diff"] for m in metrics if "weights/probe_logprob_diff" in m]
    assert diffs and max(diffs) < 1e-4  # each applied version scores as the learner's
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "lora/export")  # the merged model, a plain HF one
    # the final version the generator applied is, byte for byte, the adapter the learner exported
    final = {k.removeprefix("base_model.model.").removesuffix(".weight"): v for k, v in adapter.items()}
    last = max(applied, key=lambda m: m["generator/version"])
    assert last["generator/version"] == 3 and last["weights/checksum"] == state_dict_checksum(final)
