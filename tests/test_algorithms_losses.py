"""Policy losses, aggregations, the PPO critic loss and KL estimators against slow references (float64).

Notation: token t of sequence i has log pi_{i,t} (learner, differentiated), log pi_old (the anchor),
advantage A, detached weight w, mask m; r = pi / pi_old; |y_i| = sum_t m_{i,t}; N_tok, N_seq, L_max are
the GLOBAL counts of the optimizer step. The paper objectives J (maximised) and their loss l = -w J:

    PPO / DAPO   J = min(r A, clip(r, 1 - eps_lo, 1 + eps_hi) A);  dual clip (A < 0): J = max(J, c A)
                 dJ/dlog pi = r A on the unclipped branch, else 0
    GSPO         s_i = exp((1/|y_i|) sum_t log r_{i,t});  J_t = min(s_i A, clip(s_i) A)  (GSPO-token);
                 dJ_t/dlog pi_t = s_i A when unclipped
    PG           J = A pi / sg(pi);  dJ/dlog pi = A
    token-mean L = sum l / N_tok;  seq-mean-token-mean L = sum_i (sum_t l / |y_i|) / N_seq;
    seq-mean-token-sum L = sum l / (N_seq L_max)
    critic       l = 1/2 max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)
    KL           log r = log pi_ref - log pi;  k1 = -log r,  k2 = (log r)^2 / 2,  k3 = (r - 1) - log r
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algo_common import NAN, SETTINGS, TOL, close, floats
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from asyncrl.errors import UserError
from asyncrl.learners.kl import KL_ESTIMATORS, KLInput, get_kl_estimator, kl_loss, kl_penalty, kl_reward
from asyncrl.learners.policy_losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    LossCounts,
    PolicyLossConfig,
    PolicyLossInput,
    ValueLossInput,
    aggregate,
    get_aggregation,
    get_policy_loss,
    value_loss,
)

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- slow references


def ref_clipped_objective(ratio, a, eps_lo, eps_hi, c):
    """(J, dJ/dlog ratio, on the clipped branch, dual-clipped) for one token."""
    surr1 = ratio * a
    surr2 = min(max(ratio, 1 - eps_lo), 1 + eps_hi) * a
    j, dj, clipped, dual = (surr1, ratio * a, False, False) if surr1 <= surr2 else (surr2, 0.0, True, False)
    if c is not None and a < 0 and j < c * a:
        j, dj, clipped, dual = c * a, 0.0, False, True
    return j, dj, clipped, dual


def ref_policy_loss(name, b, cfg):
    """Per-token (loss, dloss/dlog pi, clipped, dual, ratio) for every response token, keyed by (i, t)."""
    out = {}
    for i in range(len(b["logp"])):
        pos = [t for t, m in enumerate(b["mask"][i]) if m > 0]
        log_ratios = [b["logp"][i][t] - b["old"][i][t] for t in pos]
        s_i = math.exp(sum(log_ratios) / len(pos)) if pos else 1.0
        for k, t in enumerate(pos):
            a = b["adv"][i][t] if b["per_token"] else b["adv"][i]
            w = 1.0 if b["weights"] is None else b["weights"][i][t]
            if name == "policy_gradient":
                out[i, t] = (-w * a, -w * a, False, False, math.exp(log_ratios[k]))
                continue
            ratio = s_i if name == "gspo" else math.exp(log_ratios[k])
            j, dj, clipped, dual = ref_clipped_objective(ratio, a, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
            out[i, t] = (-w * j, -w * dj, clipped, dual, ratio)
    return out


def ref_aggregation_factor(agg, b, i, counts):
    """dL / dl_{i,t} for a response token of sequence i."""
    if agg == "token-mean":
        return 1.0 / counts.num_tokens
    if agg == "seq-mean-token-mean":
        return 1.0 / (sum(b["mask"][i]) * counts.num_sequences)
    return 1.0 / (counts.num_sequences * counts.max_len)


def ref_metrics(b, per_token):
    n = len(per_token)
    ratios = [v[4] for v in per_token.values()]
    kl = 0.0
    for i, t in per_token:
        lr = b["logp"][i][t] - b["old"][i][t]
        kl += (math.exp(lr) - 1) - lr  # k3 estimate of KL(pi_old || pi)
    return {
        "clip_frac": sum(v[2] for v in per_token.values()) / n if n else 0.0,
        "dual_clip_frac": sum(v[3] for v in per_token.values()) / n if n else 0.0,
        "ratio_mean": sum(ratios) / n if n else 0.0,
        "ratio_max": max(ratios) if n else 0.0,
        "approx_kl": kl / n if n else 0.0,
    }


def ref_value_loss(values, old, returns, mask, eps_v):
    """Per-token (loss, dloss/dV, clipped) keyed by (i, t)."""
    out = {}
    for i, row in enumerate(mask):
        for t, m in enumerate(row):
            if m == 0:
                continue
            v, r = values[i][t], returns[i][t]
            unclipped = (v - r) ** 2
            if eps_v is None:
                out[i, t] = (0.5 * unclipped, v - r, False)
                continue
            v_clip = old[i][t] + min(max(v - old[i][t], -eps_v), eps_v)
            clipped = (v_clip - r) ** 2
            # past the clip V_clip no longer depends on V: the larger clipped term has no gradient
            out[i, t] = (0.5 * clipped, 0.0, True) if clipped > unclipped else (0.5 * unclipped, v - r, False)
    return out


def ref_kl(estimator, logp, ref):
    """(k, dk/dlog pi) for one token, r = pi_ref / pi."""
    log_r = ref - logp
    r = math.exp(log_r)
    if estimator == "k1":
        return -log_r, 1.0
    if estimator == "k2":
        return 0.5 * log_r**2, -log_r
    return (r - 1) - log_r, 1.0 - r


# ----------------------------------------------------------------------------- strategies


@st.composite
def policy_batches(draw, min_b: int = 1):
    """Ragged rows (response window anywhere), NaN in padded recorded slots, junk log-probs in padding."""
    b, t = draw(st.integers(min_b, 6)), draw(st.integers(1, 8))
    logp = draw(hnp.arrays(np.float64, (b, t), elements=floats(-8, 0)))
    delta = draw(hnp.arrays(np.float64, (b, t), elements=st.one_of(st.just(0.0), floats(-1.5, 1.5))))
    mask = np.zeros((b, t))
    for i in range(b):
        start = draw(st.integers(0, t))
        mask[i, start : start + draw(st.integers(0, t - start))] = 1.0
    per_token = draw(st.booleans())
    adv = draw(hnp.arrays(np.float64, (b, t) if per_token else (b,), elements=st.one_of(st.just(0.0), floats(-3, 3))))
    weights = None
    if draw(st.booleans()):
        weights = np.where(mask > 0, draw(hnp.arrays(np.float64, (b, t), elements=floats(0, 3))), NAN)
    clip_low, clip_high = draw(floats(0, 0.5)), draw(floats(0, 0.5))
    dual = draw(st.one_of(st.none(), floats(1.5, 5)))
    n_tok = float(mask.sum() + draw(st.integers(0, 20))) or 1.0  # other ranks' tokens and sequences
    counts = LossCounts(n_tok, float(b + draw(st.integers(0, 5))), float(t + draw(st.integers(0, 10))))
    return {
        "logp": logp,
        "old": np.where(mask > 0, logp - delta, NAN),
        "adv": np.where(mask > 0, adv, NAN) if per_token else adv,
        "per_token": per_token,
        "weights": weights,
        "mask": mask,
        "cfg": PolicyLossConfig(clip_low, clip_high, dual),
        "counts": counts,
    }


def make_input(b, rows=slice(None)):
    lp = torch.tensor(b["logp"][rows], requires_grad=True)
    inp = PolicyLossInput(
        logprobs=lp,
        old_logprobs=torch.tensor(b["old"][rows]),
        advantages=torch.tensor(b["adv"][rows]),
        mask=torch.tensor(b["mask"][rows]),
        weights=None if b["weights"] is None else torch.tensor(b["weights"][rows]),
    )
    return lp, inp


def as_lists(b):
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in b.items()}


# ----------------------------------------------------------------------------- policy losses x aggregations


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@SETTINGS
@given(b=policy_batches(), agg=st.sampled_from(sorted(AGGREGATIONS)))
def test_policy_loss_value_gradient_metrics(name, b, agg):
    lp, inp = make_input(b)
    out = get_policy_loss(name)(inp, b["cfg"])
    loss = aggregate(agg, out.token_loss, inp.mask, b["counts"])
    loss.backward()

    lists = as_lists(b)
    per_token = ref_policy_loss(name, lists, b["cfg"])
    token_loss = out.token_loss.detach()
    want_loss = sum(v[0] * ref_aggregation_factor(agg, lists, i, b["counts"]) for (i, t), v in per_token.items())
    assert loss.dim() == 0 and close(loss.item(), want_loss), (loss.item(), want_loss)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if (i, t) in per_token:
                v = per_token[i, t]
                assert close(float(token_loss[i, t]), v[0]), (i, t)
                want_grad = v[1] * ref_aggregation_factor(agg, lists, i, b["counts"])
                assert close(float(lp.grad[i, t]), want_grad), (i, t, float(lp.grad[i, t]), want_grad)
            else:
                assert float(token_loss[i, t]) == 0.0 and float(lp.grad[i, t]) == 0.0, (i, t)
    for metric, value in ref_metrics(lists, per_token).items():
        assert close(getattr(out, metric), value), (metric, getattr(out, metric), value)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@SETTINGS
@given(b=policy_batches(min_b=2), agg=st.sampled_from(sorted(AGGREGATIONS)), data=st.data())
def test_split_batch_gives_full_batch_loss_and_gradient(name, b, agg, data):
    """Same GLOBAL counts: the halves' losses sum to the full loss, and their gradients are the full one."""
    k = data.draw(st.integers(1, len(b["logp"]) - 1))
    fn = get_policy_loss(name)
    lp_full, full = make_input(b)
    loss_full = aggregate(agg, fn(full, b["cfg"]).token_loss, full.mask, b["counts"])
    loss_full.backward()
    parts = [make_input(b, rows) for rows in (slice(0, k), slice(k, None))]
    losses = [aggregate(agg, fn(inp, b["cfg"]).token_loss, inp.mask, b["counts"]) for _, inp in parts]
    for loss in losses:
        loss.backward()
    assert close((losses[0] + losses[1]).item(), loss_full.item())
    assert torch.allclose(torch.cat([lp.grad for lp, _ in parts]), lp_full.grad, rtol=TOL, atol=TOL)


@SETTINGS
@given(b=policy_batches())
def test_gspo_token_form_is_sequence_gspo(b):
    """Sequence advantages, w = 1, seq-mean-token-mean: the paper's sequence-level objective and gradient."""
    b = dict(
        b,
        adv=b["adv"] if not b["per_token"] else np.nanmax(np.nan_to_num(b["adv"], nan=-9), axis=1),
        per_token=False,
        weights=None,
    )
    lp, inp = make_input(b)
    cfg, counts = b["cfg"], b["counts"]
    loss = aggregate("seq-mean-token-mean", get_policy_loss("gspo")(inp, cfg).token_loss, inp.mask, counts)
    loss.backward()
    want_loss = 0.0
    for i, row in enumerate(b["mask"]):
        pos = [t for t, m in enumerate(row) if m > 0]
        if not pos:
            continue
        s_i = math.exp(sum(b["logp"][i][t] - b["old"][i][t] for t in pos) / len(pos))
        j, dj, _, _ = ref_clipped_objective(s_i, b["adv"][i], cfg.clip_low, cfg.clip_high, cfg.dual_clip)
        want_loss += -j / counts.num_sequences
        for t in pos:  # d s_i / d log pi_t = s_i / |y_i|
            assert close(float(lp.grad[i, t]), -dj / len(pos) / counts.num_sequences)
    assert close(loss.item(), want_loss)


def test_dapo_clip_higher_and_dual_clip_examples():
    lp = torch.log(torch.tensor([[1.25, 1.25, 4.0, 0.5]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    inp = PolicyLossInput(lp, torch.zeros(1, 4, dtype=torch.float64), adv, torch.ones(1, 4))
    ppo = get_policy_loss("ppo_clip")(inp, PolicyLossConfig(0.2, 0.2, dual_clip=3.0))
    dapo = get_policy_loss("ppo_clip")(inp, PolicyLossConfig(0.2, 0.28, dual_clip=None))
    # r = 1.25 > 1.2 is clipped by PPO (loss -1.2) but not by DAPO's 1.28 (loss -1.25)
    assert ppo.token_loss[0, :2].tolist() == pytest.approx([-1.2, -1.2])
    assert dapo.token_loss[0, :2].tolist() == pytest.approx([-1.25, -1.25])
    # A < 0, r = 4: plain PPO loss r|A| = 4, dual clip caps it at c|A| = 3; r = 0.5 < 0.8 is clipped to 0.8
    assert dapo.token_loss[0, 2:].tolist() == pytest.approx([4.0, 0.8])
    assert ppo.token_loss[0, 2:].tolist() == pytest.approx([3.0, 0.8])
    assert (ppo.clip_frac, ppo.dual_clip_frac, dapo.clip_frac) == (0.75, 0.25, 0.25)


def test_aggregation_needs_positive_counts_and_known_names():
    zero = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate("token-mean", zero, zero, LossCounts(0.0, 1.0))
    with pytest.raises(ValueError, match="max_len"):
        aggregate("seq-mean-token-sum", zero, zero, LossCounts(1.0, 1.0))
    with pytest.raises(UserError, match="unknown aggregation 'mean'.*seq-mean-token-mean, seq-mean-token-sum"):
        get_aggregation("mean")
    with pytest.raises(UserError, match="unknown policy loss 'grpo'.*gspo, policy_gradient, ppo_clip"):
        get_policy_loss("grpo")
    with pytest.raises(ValueError, match="dual_clip"):
        PolicyLossConfig(dual_clip=1.0)
    assert LossCounts(8.0, 4.0, 16.0).scaled(4) == LossCounts(2.0, 1.0, 16.0)


# ----------------------------------------------------------------------------- PPO critic


@SETTINGS
@given(
    shape=st.tuples(st.integers(1, 5), st.integers(1, 6)),
    eps_v=st.one_of(st.none(), floats(0.01, 1.0)),
    agg=st.sampled_from(sorted(AGGREGATIONS)),
    data=st.data(),
)
def test_value_loss_with_clipping_matches_loop(shape, eps_v, agg, data):
    values = data.draw(hnp.arrays(np.float64, shape, elements=floats(-3, 3)))
    old = values - data.draw(hnp.arrays(np.float64, shape, elements=st.one_of(st.just(0.0), floats(-1, 1))))
    returns = data.draw(hnp.arrays(np.float64, shape, elements=floats(-3, 3)))
    mask = data.draw(hnp.arrays(np.float64, shape, elements=st.sampled_from([0.0, 1.0])))
    counts = LossCounts(float(mask.sum()) or 1.0, float(shape[0]), float(shape[1]))
    v = torch.tensor(values, requires_grad=True)
    out = value_loss(
        ValueLossInput(
            v,
            torch.tensor(np.where(mask > 0, old, NAN)),
            torch.tensor(np.where(mask > 0, returns, NAN)),
            torch.tensor(mask),
        ),
        clip=eps_v,
    )
    aggregate(agg, out.token_loss, torch.tensor(mask), counts).backward()
    lists = {"mask": mask.tolist()}
    token_loss = out.token_loss.detach()
    want = ref_value_loss(values.tolist(), old.tolist(), returns.tolist(), mask.tolist(), eps_v)
    for i in range(shape[0]):
        for t in range(shape[1]):
            if (i, t) not in want:
                assert float(token_loss[i, t]) == 0.0 and float(v.grad[i, t]) == 0.0
                continue
            loss, grad, _ = want[i, t]
            assert close(float(token_loss[i, t]), loss), (i, t)
            assert close(float(v.grad[i, t]), grad * ref_aggregation_factor(agg, lists, i, counts)), (i, t)
    n = len(want)
    assert close(out.clip_frac, sum(c for _, _, c in want.values()) / n if n else 0.0)


# ----------------------------------------------------------------------------- KL estimators


@pytest.mark.parametrize("estimator", sorted(KL_ESTIMATORS))
@SETTINGS
@given(b=policy_batches(), coef=floats(0, 1))
def test_kl_estimator_value_gradient_and_placements(estimator, b, coef):
    lp = torch.tensor(b["logp"], requires_grad=True)
    ref = torch.tensor(b["old"])  # NaN in padded slots
    inp = KLInput(lp, ref, torch.tensor(b["mask"]))
    weights = None if b["weights"] is None else torch.tensor(b["weights"])
    kl_loss(inp, estimator, coef, weights).sum().backward()
    per_token = kl_penalty(inp, estimator).detach()
    reward = kl_reward(inp, estimator, coef)
    assert not reward.requires_grad
    for i, row in enumerate(b["mask"]):
        for t, m in enumerate(row):
            if m == 0:
                assert float(per_token[i, t]) == float(reward[i, t]) == float(lp.grad[i, t]) == 0.0
                continue
            k, dk = ref_kl(estimator, b["logp"][i][t], b["old"][i][t])
            w = 1.0 if weights is None else b["weights"][i][t]
            assert close(float(per_token[i, t]), k) and close(float(reward[i, t]), -coef * k)
            assert close(float(lp.grad[i, t]), coef * w * dk), (i, t)


@settings(max_examples=30, deadline=None)
@given(
    logits=hnp.arrays(np.float64, st.tuples(st.just(2), st.integers(2, 6)), elements=floats(-4, 4)),
)
def test_k1_and_k3_are_unbiased_k2_is_not_negative(logits):
    """Exact expectation over a categorical: E_pi[k1] = E_pi[k3] = KL(pi || ref) = sum_a pi log(pi / ref)."""
    log_pi = torch.log_softmax(torch.tensor(logits[0]), 0)
    log_ref = torch.log_softmax(torch.tensor(logits[1]), 0)
    kl = float((log_pi.exp() * (log_pi - log_ref)).sum())
    inp = KLInput(log_pi[None], log_ref[None], torch.ones(1, len(log_pi)))  # one "token" per action
    for estimator in ("k1", "k3"):
        assert close(float((log_pi.exp() * kl_penalty(inp, estimator)[0]).sum()), kl, 1e-9)
    assert float(kl_penalty(inp, "k2").min()) >= 0 and float(kl_penalty(inp, "k3").min()) >= 0


def test_unknown_kl_estimator():
    with pytest.raises(UserError, match="unknown KL estimator 'k4'.*k1, k2, k3"):
        get_kl_estimator("k4")
