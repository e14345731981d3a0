"""GRPO + TIS maths against slow references written loop by loop in the paper's notation (float64).

Notation: group g has rewards r_{g,1..n}; sequence i has response tokens t with log pi_{i,t} (learner),
log mu_{i,t} (behaviour), advantage A_i (or A_{i,t}) and mask m_{i,t}; rho = pi / mu, w = min(rho, C);
N = the global token count of the optimizer step.

    A_{g,j} = (r_{g,j} - mean_g) / (std_g + eps)        (GRPO;  Dr.GRPO drops the division)
    L       = (1/N) sum_i sum_t m_{i,t} * (-w_{i,t} * A_i)
    dL / d log pi_{i,t} = -m_{i,t} * w_{i,t} * A_i / N    (w is a constant: no gradient through it)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from legacy_grpo_tis import PolicyBatch, group_advantages, grpo_tis_loss

from asyncrl.learners.loss import pad_batch, sequence_logprobs

torch.set_num_threads(1)
TOL = 1e-6
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def close(a: float, b: float, tol: float = TOL) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


def floats(lo: float, hi: float):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, width=64)


# ----------------------------------------------------------------------------- slow references


def ref_group_advantages(rewards: list[list[float]], normalize_std: bool, eps: float) -> list[list[float]]:
    out = []
    for group in rewards:
        n = len(group)
        mean = 0.0
        for r in group:
            mean += r / n
        var = 0.0
        for r in group:
            var += (r - mean) ** 2 / n  # population variance
        std = math.sqrt(var)
        row = []
        for r in group:
            row.append((r - mean) / (std + eps) if normalize_std else r - mean)
        out.append(row)
    return out


def ref_grpo_tis(logp, mu, adv, mask, cap, total_tokens):
    """Returns (loss, grad wrt log pi as nested lists, metrics dict)."""
    b_size, t_size = len(logp), len(logp[0])
    loss = 0.0
    grad = [[0.0] * t_size for _ in range(b_size)]
    weights, n_clipped, kl, mismatch = [], 0, 0.0, 0.0
    for i in range(b_size):
        for t in range(t_size):
            if mask[i][t] == 0:
                continue
            a = adv[i] if not isinstance(adv[i], list) else adv[i][t]
            log_rho = logp[i][t] - mu[i][t]
            rho = math.exp(log_rho)
            w = min(rho, cap)
            loss += -w * a / total_tokens
            grad[i][t] = -w * a / total_tokens
            weights.append(w)
            n_clipped += rho > cap
            kl += (rho - 1.0) - log_rho  # k3 estimator of KL(mu || pi) with samples from mu
            mismatch += abs(log_rho)
    n = len(weights)
    metrics = {
        "tis_clip_frac": n_clipped / n if n else 0.0,
        "tis_weight_mean": sum(weights) / n if n else 0.0,
        "tis_weight_max": max(weights) if n else 0.0,
        "behaviour_kl": kl / n if n else 0.0,
        "logprob_mismatch": mismatch / n if n else 0.0,
        "num_tokens": float(n),
    }
    return loss, grad, metrics


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


# ----------------------------------------------------------------------------- strategies


@st.composite
def reward_groups(draw):
    g, n = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    rows = []
    for _ in range(g):
        kind = draw(st.sampled_from(["equal", "binary", "real"]))
        if kind == "equal":
            rows.append([draw(floats(-3, 3))] * n)
        elif kind == "binary":
            rows.append([float(draw(st.integers(0, 1))) for _ in range(n)])
        else:
            rows.append([draw(floats(-3, 3)) for _ in range(n)])
    return rows


@st.composite
def policy_batches(draw, min_b: int = 1):
    """Ragged batch: each row's response is a window [start, start+len) of T slots; junk elsewhere."""
    b, t = draw(st.integers(min_b, 6)), draw(st.integers(1, 8))
    logp = draw(hnp.arrays(np.float64, (b, t), elements=floats(-8, 0)))
    delta = draw(hnp.arrays(np.float64, (b, t), elements=st.one_of(st.just(0.0), floats(-3, 3))))
    mask = np.zeros((b, t))
    for i in range(b):
        start = draw(st.integers(0, t))
        length = draw(st.integers(0, t - start))
        mask[i, start : start + length] = 1.0
    per_token = draw(st.booleans())
    adv = draw(hnp.arrays(np.float64, (b, t) if per_token else (b,), elements=floats(-3, 3)))
    cap = draw(floats(0.5, 5.0))
    extra = draw(st.integers(0, 20))  # other ranks' tokens: N is global, >= this batch's count
    total = float(mask.sum() + extra) or 1.0
    return logp, logp - delta, adv, mask, cap, total


def make_batch(logp, mu, adv, mask):
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    batch = PolicyBatch(
        logprobs=lp,
        behaviour_logprobs=torch.tensor(mu),
        advantages=torch.tensor(adv),
        mask=torch.tensor(mask),
    )
    return lp, batch


# ----------------------------------------------------------------------------- advantages


@SETTINGS
@given(rows=reward_groups(), normalize_std=st.booleans(), eps=floats(1e-8, 1e-2))
def test_group_advantages_match_loop(rows, normalize_std, eps):
    got = group_advantages(torch.tensor(rows, dtype=torch.float64), normalize_std, eps)
    want = ref_group_advantages(rows, normalize_std, eps)
    assert got.shape == (len(rows), len(rows[0]))
    for g, row in enumerate(want):
        for j, a in enumerate(row):
            assert close(float(got[g, j]), a), (g, j, float(got[g, j]), a)
        if len(set(rows[g])) == 1:  # all-equal rewards carry no signal
            assert all(abs(float(x)) < TOL for x in got[g])


# ----------------------------------------------------------------------------- loss, gradient, metrics


@SETTINGS
@given(case=policy_batches())
def test_grpo_tis_loss_value_gradient_metrics(case):
    logp, mu, adv, mask, cap, total = case
    lp, batch = make_batch(logp, mu, adv, mask)
    out = grpo_tis_loss(batch, tis_cap=cap, total_tokens=total)
    out.loss.backward()

    want_loss, want_grad, want_metrics = ref_grpo_tis(logp.tolist(), mu.tolist(), adv.tolist(), mask, cap, total)
    assert out.loss.dim() == 0
    assert close(out.loss.item(), want_loss)
    for i, row in enumerate(want_grad):
        for t, g in enumerate(row):
            assert close(float(lp.grad[i, t]), g), (i, t)
    for name, value in want_metrics.items():
        assert close(getattr(out, name), value), (name, getattr(out, name), value)


@SETTINGS
@given(case=policy_batches(min_b=2), data=st.data())
def test_split_batch_sums_to_full_batch(case, data):
    """Same global N: loss and gradient are additive over any split (ranks, micro-batches)."""
    logp, mu, adv, mask, cap, total = case
    k = data.draw(st.integers(1, len(logp) - 1))
    lp_full, full = make_batch(logp, mu, adv, mask)
    out_full = grpo_tis_loss(full, cap, total)
    out_full.loss.backward()

    parts = [make_batch(logp[s], mu[s], adv[s], mask[s]) for s in (slice(0, k), slice(k, None))]
    outs = [grpo_tis_loss(batch, cap, total) for _, batch in parts]
    for out in outs:
        out.loss.backward()
    assert close((outs[0].loss + outs[1].loss).item(), out_full.loss.item())
    grad = torch.cat([lp.grad for lp, _ in parts])
    assert torch.allclose(grad, lp_full.grad, rtol=TOL, atol=TOL)


def test_on_policy_weights_are_one_and_padding_is_ignored():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    mu = torch.tensor([[-1.0, -2.0, float("nan")]], dtype=torch.float64)  # junk in a padded slot
    batch = PolicyBatch(logp, mu, torch.tensor([2.0], dtype=torch.float64), torch.tensor([[1.0, 1.0, 0.0]]))
    out = grpo_tis_loss(batch, tis_cap=2.0, total_tokens=4.0)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-2.0 * 2 / 4)
    assert logp.grad.tolist() == [[-0.5, -0.5, 0.0]]
    assert (out.tis_clip_frac, out.tis_weight_mean, out.tis_weight_max) == (0.0, 1.0, 1.0)
    assert out.behaviour_kl == 0.0 and out.logprob_mismatch == 0.0


def test_empty_mask_and_bad_inputs():
    lp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    out = grpo_tis_loss(PolicyBatch(lp, lp.detach(), torch.ones(2), torch.zeros(2, 3)), 2.0, 1.0)
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.num_tokens == 0.0 and out.tis_weight_max == 0.0
    assert not lp.grad.any()
    with pytest.raises(ValueError, match="total_tokens"):
        grpo_tis_loss(PolicyBatch(lp, lp.detach(), torch.ones(2), torch.ones(2, 3)), 2.0, 0.0)
    with pytest.raises(ValueError, match="advantages"):
        PolicyBatch(lp, lp.detach(), torch.ones(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        PolicyBatch(lp, lp.detach(), torch.ones(2), torch.ones(2, 4))


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

    batch = PolicyBatch(logp.requires_grad_(), blp.double(), torch.ones(len(seqs), dtype=torch.float64), rmask)
    out = grpo_tis_loss(batch, tis_cap=2.0, total_tokens=max(1.0, float(rmask.sum())))
    assert out.num_tokens == float(sum(len(r) for _, r in seqs))
    assert out.tis_clip_frac == 0.0 and out.logprob_mismatch < 1e-6 and abs(out.behaviour_kl) < 1e-6


def test_pad_batch_rejects_bad_sequences():
    ok = np.array([1], dtype=np.int32)
    with pytest.raises(ValueError, match="empty prompt"):
        pad_batch([(np.array([], dtype=np.int32), ok, np.zeros(1, np.float32))], pad_id=0)
    with pytest.raises(ValueError, match="logprobs"):
        pad_batch([(ok, ok, np.zeros(2, np.float32))], pad_id=0)
