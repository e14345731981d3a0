"""The transformers engine: its behaviour log-probs are the learner's log-probs of the same tokens,
and it applies a new state dict in place."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.demo.model import build_model, build_tokenizer
from asyncrl.generators.engine import Sampling
from asyncrl.generators.hf_engine import HfEngine
from asyncrl.learners.batching import pad_batch, sequence_logprobs


def test_hf_engine_logprobs_match_the_learner(tmp_path):
    tok = build_tokenizer()
    model = build_model(tok, seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = load_config(None, {"model.path": str(tmp_path), "model.recipe": None, "generator.engine.type": "hf"})
    engine = HfEngine(cfg.model, seed=0)
    torch.manual_seed(1)
    state = {k: v + 0.02 * torch.randn_like(v) for k, v in model.state_dict().items()}
    engine.load_weights(state)
    model.load_state_dict(state)
    prompts = [tok.encode("sort:dcba="), tok.encode("sort:ponmlk=")]  # different lengths: left padding
    outs = engine.generate(prompts, Sampling(n=3, temperature=0.7, top_p=1.0, max_new_tokens=6))
    assert [len(o) for o in outs] == [3, 3]
    seqs = [(p, c.tokens, c.logprobs) for p, group in zip(prompts, outs, strict=True) for c in group]
    batch = pad_batch(
        [(torch.tensor(p).numpy(), torch.tensor(t).numpy(), torch.tensor(lp).numpy()) for p, t, lp in seqs],
        tok.pad_token_id,
    )
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    learner = sequence_logprobs(logits, batch["input_ids"], temperature=0.7)
    mask = batch["response_mask"].bool()
    assert torch.allclose(learner[mask], batch["behaviour_logprobs"][mask], atol=1e-5)


def test_hf_engine_truncates_and_stops_as_asked(tmp_path):
    """top_k / min_p: every sampled token is inside the truncated set, its log-prob renormalised over
    it; a stop string ends a completion at the token that completes it."""
    from asyncrl.chat import stop_at
    from asyncrl.generators.hf_engine import processed_logprobs

    tok = build_tokenizer()
    build_model(tok, seed=0).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = load_config(None, {"model.path": str(tmp_path), "model.recipe": None, "generator.engine.type": "hf"})
    engine = HfEngine(cfg.model, seed=0)
    logits = torch.randn(4, 50)
    lp = processed_logprobs(logits, Sampling(1, 0.5, 1.0, 1, top_k=3))
    assert torch.isfinite(lp).sum(-1).tolist() == [3] * 4 and torch.allclose(lp.exp().sum(-1), torch.ones(4))
    lp = processed_logprobs(logits, Sampling(1, 1.0, 1.0, 1, min_p=0.3))
    probs = torch.softmax(logits, -1)
    assert torch.equal(torch.isfinite(lp), probs >= 0.3 * probs.amax(-1, keepdim=True))
    prompt = tok.encode("sort:dcba=")
    (free,) = engine.generate([prompt], Sampling(1, 0.0, 1.0, 10))[0]
    text = tok.decode(free.tokens, skip_special_tokens=True)
    stop = text[1:3]
    (cut,) = engine.generate([prompt], Sampling(1, 0.0, 1.0, 10, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and free.tokens[: len(cut.tokens)] == cut.tokens
    assert stop_at(tok.decode(cut.tokens, skip_special_tokens=True), [stop]) is not None
    assert stop_at(tok.decode(cut.tokens[:-1], skip_special_tokens=True), [stop]) is None


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def torch_threads(request):
    """torch's intra-op threads for the test: kernels split a batch by thread count (and by CPU: AMX, AVX-512)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


LOGPROB_TOL = 1e-5  # float32 log-probs of the same row computed in batches of other shapes (1 vs 4 rows)


def test_hf_engine_reports_an_n_sample_request_per_sample(tmp_path, torch_threads):
    """One request of n samples: each sample once, finished, under the request's id with its index; with
    greedy sampling every sample is the single request's completion: the same tokens, and the same log-probs
    up to float32 rounding (the engine ran them as other rows of one batch, whose kernels may sum in another
    order: bit-equality is not what a batch promises)."""
    tok = build_tokenizer()
    build_model(tok, seed=0).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = load_config(None, {"model.path": str(tmp_path), "model.recipe": None, "generator.engine.type": "hf"})
    engine = HfEngine(cfg.model, seed=0)
    assert engine.multi_sample
    prompt = tok.encode("sort:dcba=")
    engine.add_request("one", prompt, Sampling(1, 0.0, 1.0, 6))
    engine.add_request("many", prompt, Sampling(3, 0.0, 1.0, 6))
    outs = engine.step()
    (one,) = [o for o in outs if o.request_id == "one"]
    many = [o for o in outs if o.request_id == "many"]
    assert [o.index for o in many] == [0, 1, 2] and all(o.finished for o in many)
    assert all(o.tokens == one.tokens for o in many)
    assert all(o.logprobs == pytest.approx(one.logprobs, rel=0, abs=LOGPROB_TOL) for o in many)
