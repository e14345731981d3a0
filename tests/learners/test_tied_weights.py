"""Tied embeddings travel once: a version's bytes are the model's unique parameter bytes, and both
engines re-tie the LM head (transformers through the model's own tie, vLLM by skipping a tied head)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from asyncrl.config import load_config
from asyncrl.demo.model import build_tokenizer
from asyncrl.generators.hf_engine import HfEngine
from asyncrl.weights import setup_publisher, setup_subscriber
from asyncrl.weights.ties import module_aliases, retied, untied

PROBE = [1, 5, 9, 3, 7, 2, 8, 4]


def tied_model(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


def moved(model, seed: int) -> dict[str, torch.Tensor]:
    """The model's weights moved by noise, tied ones once (as the learner publishes them)."""
    torch.manual_seed(seed)
    return {k: v + 0.05 * torch.randn_like(v) for k, v in untied(model).items()}


def hf_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        x = torch.tensor([ids])
        logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
    return logp.gather(-1, x[0, 1:, None])[:, 0].tolist()


def test_a_tied_head_is_published_once_and_retied(tmp_path):
    model = tied_model(tmp_path)
    aliases = module_aliases(model)
    assert aliases == {"model.embed_tokens.weight": "lm_head.weight"}  # published under the head's name
    unique = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() lists a tie once
    state = moved(model, seed=1)
    assert "model.embed_tokens.weight" not in state
    cfg = load_config(None, {"model.path": str(tmp_path), "model.recipe": None, "generator.engine.type": "hf"})
    publisher = setup_publisher(cfg.weights)
    subscriber = setup_subscriber(cfg.weights, publisher.address, "generator-0", have=0)
    try:
        publisher.publish(1, state)
        update = None
        for _ in range(100):
            update = update or subscriber.poll(timeout_ms=100)
        assert update is not None and update.nbytes == unique
        engine = HfEngine(cfg.model, seed=0)
        engine.load_weights(retied(update.tensors, aliases))  # as the generator's pump does
    finally:
        subscriber.close()
        publisher.close()
    head, embed = engine.model.lm_head.weight, engine.model.model.embed_tokens.weight
    assert head.data_ptr() == embed.data_ptr() and torch.equal(head, state["lm_head.weight"])
    model.load_state_dict({**state, "model.embed_tokens.weight": state["lm_head.weight"]})
    assert engine.score(PROBE) == pytest.approx(hf_logprobs(model, PROBE), abs=1e-6)
    engine.load_weights(update.tensors)  # or as published: the model's own tie fills the alias
    assert engine.score(PROBE) == pytest.approx(hf_logprobs(model, PROBE), abs=1e-6)
    with pytest.raises(ValueError, match="missing"):  # a version without the tied tensor is refused
        engine.load_weights({k: v for k, v in state.items() if k != "lm_head.weight"})


VLLM_SCORE = """
import json, sys
from safetensors.torch import load_file
from asyncrl.config import load_config
from asyncrl.generators.vllm_engine import VllmEngine
from asyncrl.weights.ties import retied
cfg = load_config(None, {"model.path": sys.argv[1], "model.recipe": None})
engine = VllmEngine(cfg.generator.engine, cfg.model, 8, seed=0)
engine.load_weights(retied(load_file(sys.argv[2]), json.loads(sys.argv[4])))
print("SCORE", json.dumps(engine.score(json.loads(sys.argv[3]))))
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_a_tied_model_from_the_untied_version(tmp_path):
    pytest.importorskip("vllm")
    model = tied_model(tmp_path / "model")
    state = moved(model, seed=2)
    save_file(state, tmp_path / "v1.safetensors")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    args = [str(tmp_path / "model"), str(tmp_path / "v1.safetensors"), json.dumps(PROBE)]
    args.append(json.dumps(module_aliases(model)))
    out = subprocess.run(
        [sys.executable, "-c", VLLM_SCORE, *args], capture_output=True, text=True, env=env, timeout=600
    )  # its own process: one vLLM engine per process
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Failed to load weights" not in out.stderr and "not loaded" not in out.stderr, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("SCORE "))
    model.load_state_dict({**state, "model.embed_tokens.weight": state["lm_head.weight"]})
    assert json.loads(line.removeprefix("SCORE ")) == pytest.approx(hf_logprobs(model, PROBE), abs=1e-4)
