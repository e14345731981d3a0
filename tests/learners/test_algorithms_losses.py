"""Policy losses, aggregations, the PPO critic loss and KL estimators against slow references.

The implementations run in float64 and in float32 (the learner's dtype); the references in float64 on
the same rounded inputs. At a kink (a clip edge, a tie of the min / max) the two may land on opposite
sides by a rounding error: there the reference lists every one-sided derivative, and the
implementation must give one of them (``algo_common.near``).

Notation: token t of sequence i has log pi_{i,t} (learner, differentiated), log pi_old (the anchor),
advantage A, detached weight w, mask m; r = pi / pi_old; |y_i| = sum_t m_{i,t}; N_tok, N_seq, L_max are
the GLOBAL counts of the optimizer step. The paper objectives J (maximised) and their loss l = -w J:

    PPO / DAPO   J = min(r A, clip(r, 1 - eps_lo, 1 + eps_hi) A);  dual clip (A < 0): J = max(J, c A)
                 dJ/dlog pi = r A on the unclipped branch, else 0
                 (log r is clamped to +-20 before exp: past it J is constant, see policy_losses)
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
from algo_common import DTYPES, NAN, SETTINGS, close, floats, near, rounded, tols
from hypothesis import example, given, settings
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


def ref_clipped_objective(ratio, a, eps_lo, eps_hi, c, dtype=torch.float64):
    """J = min(r A, clip(r) A) (dual clip, A < 0: max(J, c A)) of one token, and its one-sided derivatives.

    Returns (J, {dJ/dlog ratio}, {on the clipped branch}, {dual-clipped}): one element each off a kink;
    within rounding of a clip edge or of a tie of the min / max, every side's.
    """
    lo, hi = 1 - eps_lo, 1 + eps_hi
    surr1 = ratio * a
    surr2 = min(max(ratio, lo), hi) * a
    j = min(surr1, surr2)
    outside = ratio < lo or ratio > hi
    if near(ratio, lo, dtype) or near(ratio, hi, dtype) or (outside and near(surr1, surr2, dtype)):
        sides = {(ratio * a, False), (0.0, True)}
    else:
        sides = {(ratio * a, False)} if surr1 <= surr2 else {(0.0, True)}
    grads, clipped, dual = {g for g, _ in sides}, {f for _, f in sides}, {False}
    if c is not None and a < 0:
        if near(j, c * a, dtype):
            grads, clipped, dual = grads | {0.0}, clipped | {False}, {False, True}
        elif j < c * a:
            grads, clipped, dual = {0.0}, {False}, {True}
        j = max(j, c * a)
    return j, grads, clipped, dual


def ref_policy_loss(name, b, cfg, dtype=torch.float64):
    """Per-token (loss, {dloss/dlog pi}, {clipped}, {dual}, ratio) for every response token, keyed by (i, t)."""
    out = {}
    for i in range(len(b["logp"])):
        pos = [t for t, m in enumerate(b["mask"][i]) if m > 0]
        log_ratios = [b["logp"][i][t] - b["old"][i][t] for t in pos]
        s_i = math.exp(sum(log_ratios) / len(pos)) if pos else 1.0
        for k, t in enumerate(pos):
            a = b["adv"][i][t] if b["per_token"] else b["adv"][i]
            w = 1.0 if b["weights"] is None else b["weights"][i][t]
            if name == "policy_gradient":
                out[i, t] = (-w * a, {-w * a}, {False}, {False}, math.exp(log_ratios[k]))
                continue
            ratio = s_i if name == "gspo" else math.exp(log_ratios[k])
            j, dj, clipped, dual = ref_clipped_objective(ratio, a, cfg.clip_low, cfg.clip_high, cfg.dual_clip, dtype)
            out[i, t] = (-w * j, {-w * g for g in dj}, clipped, dual, ratio)
    return out


def ref_aggregation_factor(agg, b, i, counts):
    """dL / dl_{i,t} for a response token of sequence i."""
    if agg == "token-mean":
        return 1.0 / counts.num_tokens
    if agg == "seq-mean-token-mean":
        return 1.0 / (sum(b["mask"][i]) * counts.num_sequences)
    return 1.0 / (counts.num_sequences * counts.max_len)


def ref_metrics(b, per_token):
    """Each metric's value; the clip fractions as (lowest, highest) over the sides of any kink."""
    n = len(per_token)
    ratios = [v[4] for v in per_token.values()]
    kl = 0.0
    for i, t in per_token:
        lr = b["logp"][i][t] - b["old"][i][t]
        kl += (math.exp(lr) - 1) - lr  # k3 estimate of KL(pi_old || pi)

    def frac(k):
        return (sum(min(v[k]) for v in per_token.values()) / n, sum(max(v[k]) for v in per_token.values()) / n)

    return {
        "clip_frac": frac(2) if n else (0.0, 0.0),
        "dual_clip_frac": frac(3) if n else (0.0, 0.0),
        "ratio_mean": sum(ratios) / n if n else 0.0,
        "ratio_max": max(ratios) if n else 0.0,
        "approx_kl": kl / n if n else 0.0,
    }


def ref_value_loss(values, old, returns, mask, eps_v, dtype=torch.float64):
    """Per-token (loss, {dloss/dV}, {clipped}) keyed by (i, t); every side's derivative at a kink."""
    out = {}
    for i, row in enumerate(mask):
        for t, m in enumerate(row):
            if m == 0:
                continue
            v, r = values[i][t], returns[i][t]
            unclipped = (v - r) ** 2
            if eps_v is None:
                out[i, t] = (0.5 * unclipped, {v - r}, {False})
                continue
            d = v - old[i][t]
            v_clip = old[i][t] + min(max(d, -eps_v), eps_v)
            clipped = (v_clip - r) ** 2
            # past the clip V_clip no longer depends on V: the larger clipped term has no gradient
            if near(abs(d), eps_v, dtype) or (abs(d) > eps_v and near(clipped, unclipped, dtype)):
                out[i, t] = (0.5 * max(clipped, unclipped), {v - r, 0.0}, {False, True})
            elif abs(d) > eps_v and clipped > unclipped:
                out[i, t] = (0.5 * clipped, {0.0}, {True})
            else:
                out[i, t] = (0.5 * unclipped, {v - r}, {False})
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


def make_input(b, rows=slice(None), dtype=torch.float64):
    lp = torch.tensor(b["logp"][rows], dtype=dtype, requires_grad=True)
    inp = PolicyLossInput(
        logprobs=lp,
        old_logprobs=torch.tensor(b["old"][rows], dtype=dtype),
        advantages=torch.tensor(b["adv"][rows], dtype=dtype),
        mask=torch.tensor(b["mask"][rows], dtype=dtype),
        weights=None if b["weights"] is None else torch.tensor(b["weights"][rows], dtype=dtype),
    )
    return lp, inp


def as_lists(b, dtype=torch.float64):
    """The batch as the reference sees it: nested lists of the values a dtype learner holds."""
    out = {}
    for k, v in b.items():
        out[k] = rounded(v, dtype).tolist() if isinstance(v, np.ndarray) else v
    return out


def one_of(x: float, candidates: set[float], dtype: torch.dtype) -> bool:
    return any(close(x, c, dtype=dtype) for c in candidates)


def in_range(x: float, bounds: tuple[float, float], dtype: torch.dtype) -> bool:
    return close(x, bounds[0], dtype=dtype) or close(x, bounds[1], dtype=dtype) or bounds[0] <= x <= bounds[1]


# ----------------------------------------------------------------------------- policy losses x aggregations


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@SETTINGS
@given(b=policy_batches(), agg=st.sampled_from(sorted(AGGREGATIONS)))
def test_policy_loss_value_gradient_metrics(name, dtype, b, agg):
    lp, inp = make_input(b, dtype=dtype)
    out = get_policy_loss(name)(inp, b["cfg"])
    loss = aggregate(agg, out.token_loss, inp.mask, b["counts"])
    loss.backward()

    lists = as_lists(b, dtype)
    per_token = ref_policy_loss(name, lists, b["cfg"], dtype)
    token_loss = out.token_loss.detach()
    want_loss = sum(v[0] * ref_aggregation_factor(agg, lists, i, b["counts"]) for (i, t), v in per_token.items())
    assert loss.dim() == 0 and loss.dtype == dtype and close(loss.item(), want_loss, dtype=dtype), (
        loss.item(),
        want_loss,
    )
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if (i, t) in per_token:
                v = per_token[i, t]
                assert close(float(token_loss[i, t]), v[0], dtype=dtype), (i, t)
                want_grads = {g * ref_aggregation_factor(agg, lists, i, b["counts"]) for g in v[1]}
                assert one_of(float(lp.grad[i, t]), want_grads, dtype), (i, t, float(lp.grad[i, t]), want_grads)
            else:
                assert float(token_loss[i, t]) == 0.0 and float(lp.grad[i, t]) == 0.0, (i, t)
    for metric, value in ref_metrics(lists, per_token).items():
        got = getattr(out, metric)
        ok = in_range(got, value, dtype) if isinstance(value, tuple) else close(got, value, dtype=dtype)
        assert ok, (metric, got, value)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@SETTINGS
@given(b=policy_batches(min_b=2), agg=st.sampled_from(sorted(AGGREGATIONS)), data=st.data())
def test_split_batch_gives_full_batch_loss_and_gradient(name, dtype, b, agg, data):
    """Same GLOBAL counts: the halves' losses sum to the full loss, and their gradients are the full one."""
    k = data.draw(st.integers(1, len(b["logp"]) - 1))
    fn = get_policy_loss(name)
    lp_full, full = make_input(b, dtype=dtype)
    loss_full = aggregate(agg, fn(full, b["cfg"]).token_loss, full.mask, b["counts"])
    loss_full.backward()
    parts = [make_input(b, rows, dtype) for rows in (slice(0, k), slice(k, None))]
    losses = [aggregate(agg, fn(inp, b["cfg"]).token_loss, inp.mask, b["counts"]) for _, inp in parts]
    for loss in losses:
        loss.backward()
    assert close((losses[0] + losses[1]).item(), loss_full.item(), dtype=dtype)
    assert torch.allclose(torch.cat([lp.grad for lp, _ in parts]), lp_full.grad, **tols(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(b=policy_batches())
def test_gspo_token_form_is_sequence_gspo(dtype, b):
    """Sequence advantages, w = 1, seq-mean-token-mean: the paper's sequence-level objective and gradient."""
    b = dict(
        b,
        adv=b["adv"] if not b["per_token"] else np.nanmax(np.nan_to_num(b["adv"], nan=-9), axis=1),
        per_token=False,
        weights=None,
    )
    lp, inp = make_input(b, dtype=dtype)
    cfg, counts = b["cfg"], b["counts"]
    loss = aggregate("seq-mean-token-mean", get_policy_loss("gspo")(inp, cfg).token_loss, inp.mask, counts)
    loss.backward()
    want_loss = 0.0
    lists = as_lists(b, dtype)
    for i, row in enumerate(lists["mask"]):
        pos = [t for t, m in enumerate(row) if m > 0]
        if not pos:
            continue
        s_i = math.exp(sum(lists["logp"][i][t] - lists["old"][i][t] for t in pos) / len(pos))
        j, dj, _, _ = ref_clipped_objective(s_i, lists["adv"][i], cfg.clip_low, cfg.clip_high, cfg.dual_clip, dtype)
        want_loss += -j / counts.num_sequences
        for t in pos:  # d s_i / d log pi_t = s_i / |y_i|
            want = {-g / len(pos) / counts.num_sequences for g in dj}
            assert one_of(float(lp.grad[i, t]), want, dtype), (i, t, float(lp.grad[i, t]), want)
    assert close(loss.item(), want_loss, dtype=dtype)


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


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize(
    ("log_ratio", "adv", "weight"),
    [
        (100.0, 1.0, 1.0),
        (100.0, 0.0, 1.0),
        (100.0, 1.0, 0.0),
        (100.0, -1.0, 1.0),
        (-100.0, 1.0, 1.0),
        (-100.0, -1.0, 1.0),
    ],
)
def test_an_overflowing_ratio_gives_a_finite_loss_and_gradient(name, log_ratio, adv, weight):
    """float32 exp overflows past log r = 88.7: lp = -1 against an anchor of -101 once gave a NaN gradient
    on the clipped branch, and a NaN loss with A = 0 or w = 0 (0 * inf)."""
    lp = torch.tensor([[-1.0], [-1.0]], requires_grad=True)  # row 0 overflows, row 1 is on-policy
    inp = PolicyLossInput(
        lp,
        lp.detach() - torch.tensor([[log_ratio], [0.0]]),
        torch.tensor([adv, adv]),
        torch.ones(2, 1),
        torch.tensor([[weight], [weight]]),
    )
    out = get_policy_loss(name)(inp, PolicyLossConfig())
    out.token_loss.sum().backward()
    assert torch.isfinite(out.token_loss).all() and torch.isfinite(lp.grad).all(), (out.token_loss, lp.grad)
    assert all(math.isfinite(getattr(out, m)) for m in ("ratio_mean", "ratio_max", "approx_kl", "clip_frac"))
    if name != "policy_gradient" and adv * log_ratio > 0 or weight == 0.0 or adv == 0.0:
        assert float(lp.grad[0, 0]) == 0.0  # the clipped branch (or no weight): J is flat in log pi
    if weight == 0.0 or adv == 0.0:
        assert float(out.token_loss.detach().abs().sum()) == 0.0
    assert float(lp.grad[1, 0]) == -weight * adv  # the on-policy row is untouched


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


@st.composite
def value_batches(draw):
    shape = draw(st.tuples(st.integers(1, 5), st.integers(1, 6)))
    values = draw(hnp.arrays(np.float64, shape, elements=floats(-3, 3)))
    return {
        "values": values,
        "old": values - draw(hnp.arrays(np.float64, shape, elements=st.one_of(st.just(0.0), floats(-1, 1)))),
        "returns": draw(hnp.arrays(np.float64, shape, elements=floats(-3, 3))),
        "mask": draw(hnp.arrays(np.float64, shape, elements=st.sampled_from([0.0, 1.0]))),
        "eps_v": draw(st.one_of(st.none(), floats(0.01, 1.0))),
    }


# V - V_old exactly on the clip edge: the implementation's one-sided gradient and the loop's may differ
_ON_THE_EDGE = {
    "values": np.array([[0.0, 0.005]]),
    "old": np.array([[0.0, 0.005]]) - np.array([[0.0, 1.0]]),
    "returns": np.zeros((1, 2)),
    "mask": np.ones((1, 2)),
    "eps_v": 1.0,
}


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(case=value_batches(), agg=st.sampled_from(sorted(AGGREGATIONS)))
@example(case=_ON_THE_EDGE, agg="token-mean")
def test_value_loss_with_clipping_matches_loop(dtype, case, agg):
    mask, eps_v = case["mask"], case["eps_v"]
    shape = mask.shape
    counts = LossCounts(float(mask.sum()) or 1.0, float(shape[0]), float(shape[1]))
    v = torch.tensor(case["values"], dtype=dtype, requires_grad=True)
    out = value_loss(
        ValueLossInput(
            v,
            torch.tensor(np.where(mask > 0, case["old"], NAN), dtype=dtype),
            torch.tensor(np.where(mask > 0, case["returns"], NAN), dtype=dtype),
            torch.tensor(mask, dtype=dtype),
        ),
        clip=eps_v,
    )
    aggregate(agg, out.token_loss, torch.tensor(mask, dtype=dtype), counts).backward()
    lists = {"mask": mask.tolist()}
    token_loss = out.token_loss.detach()
    values, old, returns = (rounded(case[k], dtype).tolist() for k in ("values", "old", "returns"))
    want = ref_value_loss(values, old, returns, mask.tolist(), eps_v, dtype)
    for i in range(shape[0]):
        for t in range(shape[1]):
            if (i, t) not in want:
                assert float(token_loss[i, t]) == 0.0 and float(v.grad[i, t]) == 0.0
                continue
            loss, grads, _ = want[i, t]
            assert close(float(token_loss[i, t]), loss, dtype=dtype), (i, t)
            want_grads = {g * ref_aggregation_factor(agg, lists, i, counts) for g in grads}
            assert one_of(float(v.grad[i, t]), want_grads, dtype), (i, t, float(v.grad[i, t]), want_grads)
    n = len(want)
    lo, hi = (sum(f(c) for _, _, c in want.values()) / n if n else 0.0 for f in (min, max))
    assert in_range(out.clip_frac, (lo, hi), dtype), (out.clip_frac, lo, hi)


# ----------------------------------------------------------------------------- KL estimators


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("estimator", sorted(KL_ESTIMATORS))
@SETTINGS
@given(b=policy_batches(), coef=floats(0, 1))
def test_kl_estimator_value_gradient_and_placements(estimator, dtype, b, coef):
    lp = torch.tensor(b["logp"], dtype=dtype, requires_grad=True)
    ref = torch.tensor(b["old"], dtype=dtype)  # NaN in padded slots
    inp = KLInput(lp, ref, torch.tensor(b["mask"], dtype=dtype))
    weights = None if b["weights"] is None else torch.tensor(b["weights"], dtype=dtype)
    kl_loss(inp, estimator, coef, weights).sum().backward()
    per_token = kl_penalty(inp, estimator).detach()
    reward = kl_reward(inp, estimator, coef)
    assert not reward.requires_grad
    lists = as_lists(b, dtype)
    for i, row in enumerate(b["mask"]):
        for t, m in enumerate(row):
            if m == 0:
                assert float(per_token[i, t]) == float(reward[i, t]) == float(lp.grad[i, t]) == 0.0
                continue
            k, dk = ref_kl(estimator, lists["logp"][i][t], lists["old"][i][t])
            w = 1.0 if weights is None else lists["weights"][i][t]
            assert close(float(per_token[i, t]), k, dtype=dtype) and close(float(reward[i, t]), -coef * k, dtype=dtype)
            assert close(float(lp.grad[i, t]), coef * w * dk, dtype=dtype), (i, t)


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
