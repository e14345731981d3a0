"""vLLM's KV cache on CPU: sized to what a generator's sequences can fill at once, not to the whole ceiling
(``generators.engine.cpu_kv_cache_bytes``)."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config
from asyncrl.generators.engine import KV_BLOCK_TOKENS, cpu_kv_cache_bytes, kv_bytes_per_token


def _llama(path, **kw):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=259, **kw).save_pretrained(path)
    return str(path)


def _cfg(path, **overrides):
    return load_config(None, {"model.path": str(path), "model.recipe": None, **overrides})


def test_a_token_holds_keys_and_values_of_every_layer(tmp_path):
    path = _llama(tmp_path, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, hidden_size=256)
    assert kv_bytes_per_token(path, "float32") == 3 * 2 * 2 * 32 * 4  # layers x (K, V) x kv heads x head size
    assert kv_bytes_per_token(path, "bfloat16") == 3 * 2 * 2 * 32 * 2
    grouped = _llama(tmp_path / "mha", num_hidden_layers=2, num_attention_heads=4, hidden_size=128, head_dim=64)
    assert kv_bytes_per_token(grouped, "float32") == 2 * 2 * 4 * 64 * 4  # no kv heads given: every head


def test_layers_that_are_not_attention_leave_the_ceiling(tmp_path):
    from transformers import JambaConfig

    JambaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path)
    assert kv_bytes_per_token(str(tmp_path), "float32") is None
    cfg = _cfg(tmp_path)
    assert cpu_kv_cache_bytes(cfg.model, 8, 64, cfg.generator.engine) == cfg.generator.engine.kv_cache_gb << 30


def test_room_for_every_sequence_in_whole_blocks_and_never_past_the_ceiling(tmp_path):
    path = _llama(tmp_path, num_hidden_layers=2, num_attention_heads=4, hidden_size=128)
    cfg = _cfg(path)
    per_token = 2 * 2 * 4 * 32 * 4
    # 8 sequences (and vLLM's null block) of 100 tokens, each in one 256-token block
    assert cpu_kv_cache_bytes(cfg.model, 8, 100, cfg.generator.engine) == 9 * KV_BLOCK_TOKENS * per_token
    assert cpu_kv_cache_bytes(cfg.model, 8, 300, cfg.generator.engine) == 9 * 2 * KV_BLOCK_TOKENS * per_token
    two = _cfg(path, **{"generator.engine.kv_cache_gb": 2}).generator.engine
    assert cpu_kv_cache_bytes(cfg.model, 512, 32768, two) == 2 << 30


@pytest.mark.vllm
@pytest.mark.slow
def test_an_engine_takes_what_its_sequences_fill_and_runs_them_all_at_once(tiny_model_dir, monkeypatch):
    pytest.importorskip("vllm")
    from vllm_common import start_engine

    from asyncrl.generators.engine import Sampling

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the environment's setting would win
    seqs = 8
    engine = start_engine(tiny_model_dir, max_num_seqs=seqs)
    cfg = _cfg(tiny_model_dir)
    cache = engine.llm.llm_engine.vllm_config.cache_config
    runner = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner
    held = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    assert held <= cpu_kv_cache_bytes(cfg.model, seqs, engine.max_model_len, cfg.generator.engine) < 1 << 30
    assert (cache.num_gpu_blocks - 1) * cache.block_size >= seqs * engine.max_model_len  # every one full at once
    prompt = [257, *b"sort:dcba="]
    sampling = Sampling(n=seqs, temperature=1.0, top_p=1.0, max_new_tokens=engine.max_model_len - len(prompt))
    engine.add_request("all", prompt, sampling)
    steps, running = 0, []
    while engine.llm.llm_engine.has_unfinished_requests():
        outs = engine.step()
        running.append(len(outs))
        steps += 1
        assert steps <= 2 * engine.max_model_len
    assert running[0] == seqs  # all 8 scheduled in the first step: no sequence waited for cache blocks
