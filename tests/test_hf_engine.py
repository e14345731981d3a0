"""The transformers engine: its behaviour log-probs are the learner's log-probs of the same tokens,
and it applies a new state dict in place."""

from __future__ import annotations

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
