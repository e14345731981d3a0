"""Batching against slow references: token log-probs of a padded batch (float64, loop by loop) and the
alignment of ``pad_batch`` with ``sequence_logprobs`` (position j scores the token at j + 1)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from asyncrl.learners.batching import pad_batch, sequence_logprobs

torch.set_num_threads(1)
TOL = 1e-6
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def close(a: float, b: float, tol: float = TOL) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


def floats(lo: float, hi: float):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, width=64)


# ----------------------------------------------------------------------------- slow reference


def ref_sequence_logprobs(logits, ids, temperature):
    out = []
    for b in range(len(ids)):
        row = []
        for j in range(len(ids[b]) - 1):
            x = [v / temperature for v in logits[b][j]]
            top = max(x)
            lse = top + math.log(sum(math.exp(v - top) for v in x))
            row.append(x[ids[b][j + 1]] - lse)
        out.append(row)
    return out


# ----------------------------------------------------------------------------- log-probs and padding


@SETTINGS
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(2, 6), st.integers(2, 7)),
    temperature=floats(0.3, 2.0),
    data=st.data(),
)
def test_sequence_logprobs_match_loop(shape, temperature, data):
    b, length, vocab = shape
    logits = data.draw(hnp.arrays(np.float64, shape, elements=floats(-20, 20)))
    ids = data.draw(hnp.arrays(np.int64, (b, length), elements=st.integers(0, vocab - 1)))
    got = sequence_logprobs(torch.tensor(logits), torch.tensor(ids), temperature)
    want = ref_sequence_logprobs(logits.tolist(), ids.tolist(), temperature)
    assert got.shape == (b, length - 1) and got.dtype == torch.float64
    for i, row in enumerate(want):
        for j, v in enumerate(row):
            assert close(float(got[i, j]), v), (i, j)


def test_sequence_logprobs_upcasts_low_precision():
    logits = torch.randn(2, 4, 5, dtype=torch.bfloat16)
    out = sequence_logprobs(logits, torch.randint(0, 5, (2, 4)), 1.0)
    assert out.dtype == torch.float32 and out.shape == (2, 3)


@st.composite
def ragged_sequences(draw, vocab: int = 7):
    seqs = []
    for _ in range(draw(st.integers(1, 5))):
        p, t = draw(st.integers(1, 5)), draw(st.integers(0, 6))
        prompt = draw(hnp.arrays(np.int32, (p,), elements=st.integers(0, vocab - 1)))
        response = draw(hnp.arrays(np.int32, (t,), elements=st.integers(0, vocab - 1)))
        seqs.append((prompt, response))
    return seqs


@SETTINGS
@given(seqs=ragged_sequences(), pad_id=st.integers(0, 6), temperature=floats(0.5, 1.5), seed=st.integers(0, 99))
def test_pad_batch_aligns_with_sequence_logprobs(seqs, pad_id, temperature, seed):
    """A bigram 'model' samples mu_t in a loop; the padded pipeline must recover mu_t at position t."""
    vocab = 7
    table = np.random.default_rng(seed).normal(size=(vocab, vocab)) * 3  # logits of next | prev

    def bigram_logprob(prev: int, nxt: int) -> float:
        x = [v / temperature for v in table[prev]]
        return x[nxt] - math.log(sum(math.exp(v) for v in x))

    triples = []
    for prompt, response in seqs:
        context = [int(prompt[-1])] + [int(x) for x in response]
        mu = [bigram_logprob(context[t], int(response[t])) for t in range(len(response))]
        triples.append((prompt, response, np.array(mu, dtype=np.float32)))
    padded = pad_batch(triples, pad_id=pad_id)
    ids, attn, rmask, blp = (padded[k] for k in ("input_ids", "attention_mask", "response_mask", "behaviour_logprobs"))

    length = max(2, max(len(p) + len(r) for p, r in seqs))
    assert ids.shape == attn.shape == (len(seqs), length)
    assert rmask.shape == blp.shape == (len(seqs), length - 1)
    for i, (prompt, response, mu) in enumerate(triples):
        p, t = len(prompt), len(response)
        assert ids[i].tolist() == [*prompt.tolist(), *response.tolist()] + [pad_id] * (length - p - t)
        assert attn[i].tolist() == [1] * (p + t) + [0] * (length - p - t)
        for j in range(length - 1):
            is_resp = p - 1 <= j < p - 1 + t
            assert rmask[i, j] == float(is_resp)
            if is_resp:  # position j predicts response token t' = j - p + 1
                assert ids[i, j + 1] == response[j - p + 1] and blp[i, j] == mu[j - p + 1]
            else:
                assert blp[i, j] == 0.0

    logits = torch.tensor(table)[ids]  # (B, L, V): the bigram model's logits at every position
    logp = sequence_logprobs(logits, ids, temperature)
    assert torch.allclose(logp * rmask, blp.double(), atol=1e-6, rtol=0)
    assert float(rmask.sum()) == float(sum(len(r) for _, r in seqs))


def test_pad_batch_rejects_bad_sequences():
    ok = np.array([1], dtype=np.int32)
    with pytest.raises(ValueError, match="empty prompt"):
        pad_batch([(np.array([], dtype=np.int32), ok, np.zeros(1, np.float32))], pad_id=0)
    with pytest.raises(ValueError, match="logprobs"):
        pad_batch([(ok, ok, np.zeros(2, np.float32))], pad_id=0)
