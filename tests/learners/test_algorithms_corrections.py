"""Off-policy corrections and presets against slow references written in the papers' notation.

The corrections run in float64 and float32 (the learner's dtype), the references in float64 on the same
rounded inputs; a token within rounding of a threshold may fall on either side (``algo_common.near``).

Notation: token t of sequence i has log mu_{i,t} (behaviour, recorded by the generator), log pi (learner)
and optionally log pi_prox (proximal, step start); the target is pi_prox when given, else pi;
rho_t = target_t / mu_t; steps s = 0..n-1 are the response positions of a sequence in order.

    tis / decoupled_ppo   w_t = min(rho_t, C)                      (anchor of the PPO ratio: mu / pi_prox)
    seq_tis               w_i = min(prod_t rho_t, C)
    icepop                w_t = rho_t if lo <= rho_t <= hi else 0
    geo_mask              w_i = 1 if lo <= (prod_t rho_t)^(1/n) <= hi else 0
    V-trace               v_s = V_s + sum_{t=s}^{n-1} gamma^{t-s} (prod_{k=s}^{t-1} c_k) delta_t,
                          delta_t = rho'_t (r_t + gamma V_{t+1} - V_t),  V_n = v_n = bootstrap,
                          pg_s = rho'_s (r_s + gamma v_{s+1} - V_s),
                          rho'_t = min(rho_bar, rho_t),  c_k = min(c_bar, rho_k)

Composed with a ratio loss (ppo_clip, gspo; Truncated IS, IcePop): with r_t = pi_t / pi_prox,t and the
weight taken at pi_prox (target = anchor = pi_prox, the policy at the start of the optimizer step),

    l_t = -w_t(pi_prox / mu) * min(r_t A_t, clip(r_t, 1 - eps_lo, 1 + eps_hi) A_t)

so the behaviour mismatch is corrected once, by w; the clip bounds the step from pi_prox.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from algo_common import DTYPES, NAN, SETTINGS, TOL, close, floats, near, rounded
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_algorithms_losses import ref_clipped_objective

from asyncrl.config.presets import PRESETS, Preset, get_preset
from asyncrl.errors import UserError
from asyncrl.learners.advantages import AdvantageConfig, AdvantageInput, get_advantage
from asyncrl.learners.corrections import CORRECTIONS, CorrectionConfig, CorrectionInput, get_correction
from asyncrl.learners.kl import KLInput, kl_loss, kl_reward
from asyncrl.learners.objective import Reducer, StepBatch, minibatch_loss, prepare_batch, step_loss
from asyncrl.learners.policy_losses import (
    LossCounts,
    PolicyLossConfig,
    PolicyLossInput,
    ValueLossInput,
    aggregate,
    get_policy_loss,
    value_loss,
)

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- slow references


def ref_weighting(name, b, cfg, dtype=torch.float64):
    """(weights {(i, t): {w}}, affected {(i, t): {bool}}, ratios tested, anchor {(i, t): log-prob}) by loops.

    A token within rounding of a threshold lists both sides' weight and flag.
    """
    weights, affected, ratios, anchor = {}, {}, [], {}
    target = b["prox"] if b["prox"] is not None else b["logp"]

    def band(x, lo, hi, keep, reject):  # keep inside [lo, hi]; either side within rounding of an edge
        if near(x, lo, dtype) or near(x, hi, dtype):
            return {keep, reject}, {False, True}
        inside = lo <= x <= hi
        return {keep if inside else reject}, {not inside}

    for i, row in enumerate(b["mask"]):
        pos = [t for t, m in enumerate(row) if m > 0]
        rho = {t: math.exp(target[i][t] - b["mu"][i][t]) for t in pos}
        prod = 1.0
        for t in pos:
            prod *= rho[t]
        geo = prod ** (1.0 / len(pos)) if pos else 1.0
        if name in ("seq_tis", "geo_mask") and pos:
            ratios.append(prod if name == "seq_tis" else geo)
        for t in pos:
            anchor[i, t] = target[i][t] if b["prox"] is not None else b["mu"][i][t]
            if name in ("tis", "decoupled_ppo"):
                weights[i, t], hit = {min(rho[t], cfg.tis_cap)}, {rho[t] > cfg.tis_cap}
                hit = {False, True} if near(rho[t], cfg.tis_cap, dtype) else hit
            elif name == "seq_tis":
                weights[i, t], hit = {min(prod, cfg.seq_tis_cap)}, {prod > cfg.seq_tis_cap}
                hit = {False, True} if near(prod, cfg.seq_tis_cap, dtype) else hit
            elif name == "icepop":
                weights[i, t], hit = band(rho[t], cfg.icepop_low, cfg.icepop_high, rho[t], 0.0)
            elif name == "geo_mask":
                weights[i, t], hit = band(geo, cfg.geo_low, cfg.geo_high, 1.0, 0.0)
            else:  # none
                weights[i, t], hit = {1.0}, {False}
            affected[i, t] = hit
            if name not in ("seq_tis", "geo_mask"):
                ratios.append(rho[t])
    return weights, affected, ratios, anchor


def ref_vtrace(b, cfg):
    """{(i, t): (v_s, pg advantage, clipped rho)} from the paper's explicit sums and products."""
    target = b["prox"] if b["prox"] is not None else b["logp"]
    out = {}
    for i, row in enumerate(b["mask"]):
        pos = [t for t, m in enumerate(row) if m > 0]
        n = len(pos)
        rho = [math.exp(target[i][t] - b["mu"][i][t]) for t in pos]
        rho_c = [min(cfg.rho_bar, x) for x in rho]
        c = [min(cfg.c_bar, x) for x in rho]
        r = [b["rewards"][i][t] for t in pos]
        v = [b["values"][i][t] for t in pos] + [b["bootstrap"][i]]
        vs = []
        for s in range(n):
            total = v[s]
            for t in range(s, n):
                trace = 1.0
                for k in range(s, t):
                    trace *= c[k]
                total += cfg.gamma ** (t - s) * trace * rho_c[t] * (r[t] + cfg.gamma * v[t + 1] - v[t])
            vs.append(total)
        vs.append(b["bootstrap"][i])
        for s, t in enumerate(pos):
            out[i, t] = (vs[s], rho_c[s] * (r[s] + cfg.gamma * vs[s + 1] - v[s]), rho_c[s], rho[s])
    return out


# ----------------------------------------------------------------------------- strategies


@st.composite
def behaviour_batches(draw, min_b: int = 1):
    """Ragged rows, NaN in every recorded padded slot, optional prox, and a random correction config."""
    b, t = draw(st.integers(min_b, 6)), draw(st.integers(1, 8))
    mask = np.zeros((b, t))
    for i in range(b):
        start = draw(st.integers(0, t))
        mask[i, start : start + draw(st.integers(0, t - start))] = 1.0
    logp = draw(hnp.arrays(np.float64, (b, t), elements=floats(-8, 0)))

    def shifted(scale: float) -> np.ndarray:
        delta = draw(hnp.arrays(np.float64, (b, t), elements=st.one_of(st.just(0.0), floats(-scale, scale))))
        return np.where(mask > 0, logp - delta, NAN)

    cfg = CorrectionConfig(
        tis_cap=draw(floats(0.5, 3)),
        seq_tis_cap=draw(floats(0.5, 3)),
        icepop_low=draw(floats(0.2, 1)),
        icepop_high=draw(floats(1, 3)),
        geo_low=draw(floats(0.5, 1)),
        geo_high=draw(floats(1, 1.5)),
        rho_bar=draw(floats(0.5, 2)),
        c_bar=draw(floats(0.5, 2)),
        gamma=draw(floats(0, 1)),
    )
    return {
        "logp": logp,
        "mu": shifted(1.5),
        "prox": shifted(0.3) if draw(st.booleans()) else None,
        "mask": mask,
        "rewards": np.where(mask > 0, draw(hnp.arrays(np.float64, (b, t), elements=floats(-2, 2))), NAN),
        "values": np.where(mask > 0, draw(hnp.arrays(np.float64, (b, t), elements=floats(-2, 2))), NAN),
        "bootstrap": draw(hnp.arrays(np.float64, (b,), elements=floats(-2, 2))),
    }, cfg


def make_input(b, dtype=torch.float64) -> CorrectionInput:
    return CorrectionInput(
        logprobs=torch.tensor(b["logp"], dtype=dtype, requires_grad=True),
        behaviour_logprobs=torch.tensor(b["mu"], dtype=dtype),
        mask=torch.tensor(b["mask"], dtype=dtype),
        prox_logprobs=None if b["prox"] is None else torch.tensor(b["prox"], dtype=dtype),
        rewards=torch.tensor(b["rewards"], dtype=dtype),
        values=torch.tensor(b["values"], dtype=dtype),
        bootstrap_value=torch.tensor(b["bootstrap"], dtype=dtype),
    )


def as_lists(b, dtype=torch.float64):
    """The batch as the reference sees it: nested lists of the values a dtype learner holds."""
    return {k: (rounded(v, dtype).tolist() if isinstance(v, np.ndarray) else v) for k, v in b.items()}


def ref_behaviour_kl(b) -> float:
    target = b["prox"] if b["prox"] is not None else b["logp"]
    terms = []
    for i, row in enumerate(b["mask"]):
        for t, m in enumerate(row):
            if m > 0:
                log_rho = target[i][t] - b["mu"][i][t]
                terms.append((math.exp(log_rho) - 1) - log_rho)  # k3 estimate of KL(mu || target)
    return sum(terms) / len(terms) if terms else 0.0


# ----------------------------------------------------------------------------- corrections vs references


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(set(CORRECTIONS) - {"vtrace"}))
@SETTINGS
@given(case=behaviour_batches())
def test_weighting_correction_matches_loop(name, dtype, case):
    b, cfg = case
    if name == "decoupled_ppo" and b["prox"] is None:
        b = dict(b, prox=b["logp"])  # decoupled PPO always has a proximal policy
    out = get_correction(name)(make_input(b, dtype), cfg)
    lists = as_lists(b, dtype)
    weights, affected, ratios, anchor = ref_weighting(name, lists, cfg, dtype)
    assert not out.weights.requires_grad and out.weights.dtype == out.old_logprobs.dtype == dtype
    for i, row in enumerate(lists["mask"]):
        for t in range(len(row)):
            if (i, t) in weights:
                got = float(out.weights[i, t])
                assert any(close(got, w, dtype=dtype) for w in weights[i, t]), (i, t, got, weights[i, t])
                assert close(float(out.old_logprobs[i, t]), anchor[i, t], dtype=dtype)
            else:
                assert float(out.weights[i, t]) == 0.0 and float(out.old_logprobs[i, t]) == 0.0
    n = len(weights)
    lo, hi = (sum(f(hit) for hit in affected.values()) / n if n else 0.0 for f in (min, max))
    assert close(out.clip_frac, lo, dtype=dtype) or close(out.clip_frac, hi, dtype=dtype) or lo <= out.clip_frac <= hi
    assert close(out.ratio_mean, sum(ratios) / len(ratios) if ratios else 0.0, dtype=dtype)
    assert close(out.ratio_max, max(ratios) if ratios else 0.0, dtype=dtype)
    assert close(out.behaviour_kl, ref_behaviour_kl(lists), dtype=dtype)


@SETTINGS
@given(case=behaviour_batches())
def test_vtrace_matches_paper_sums(case):
    b, cfg = case
    out = get_correction("vtrace")(make_input(b), cfg)
    want = ref_vtrace(as_lists(b), cfg)
    pg = out.weights * out.advantages  # IMPALA's policy-gradient advantage
    for i, row in enumerate(b["mask"]):
        for t in range(len(row)):
            if (i, t) not in want:
                assert float(out.value_targets[i, t]) == float(pg[i, t]) == float(out.weights[i, t]) == 0.0
                continue
            vs, pg_adv, rho_c, _ = want[i, t]
            assert close(float(out.value_targets[i, t]), vs), (i, t, float(out.value_targets[i, t]), vs)
            assert close(float(pg[i, t]), pg_adv) and close(float(out.weights[i, t]), rho_c), (i, t)
    rhos = [x[3] for x in want.values()]
    assert close(out.clip_frac, sum(x > cfg.rho_bar for x in rhos) / len(rhos) if rhos else 0.0)
    assert close(out.ratio_max, max(rhos) if rhos else 0.0)


@SETTINGS
@given(case=behaviour_batches(), gamma=floats(0, 1))
def test_vtrace_on_policy_is_the_monte_carlo_return_and_gae_lambda_one(case, gamma):
    """pi = mu, c_bar, rho_bar >= 1, bootstrap 0: v_s = sum_k gamma^k r_{s+k} = the GAE(lambda = 1) return."""
    b, _ = case
    b = dict(b, mu=np.where(b["mask"] > 0, b["logp"], NAN), prox=None, bootstrap=np.zeros(len(b["logp"])))
    out = get_correction("vtrace")(make_input(b), CorrectionConfig(rho_bar=1.0, c_bar=1.5, gamma=gamma))
    mask = torch.tensor(b["mask"])
    rewards = torch.tensor(np.nan_to_num(b["rewards"]))
    ret = get_advantage("gae")(
        AdvantageInput(
            torch.zeros(len(mask), dtype=torch.float64), mask, token_rewards=rewards, values=torch.tensor(b["values"])
        ),
        AdvantageConfig(gamma=gamma, lam=1.0),
    ).returns
    assert torch.allclose(out.value_targets, ret, rtol=TOL, atol=TOL)
    assert out.clip_frac == 0.0 and abs(out.behaviour_kl) < 1e-12


RATIO_LOSSES = ("ppo_clip", "gspo")
WEIGHTING = sorted(set(CORRECTIONS) - {"none", "vtrace"})


def ref_composed_loss(loss_name, correction, b, adv, cfg, loss_cfg):
    """Per token (i, t): (l_t, {dl_t / dlog pi_t}) of the paper's composition, r = pi / pi_prox,
    w = w(pi_prox / mu); ``adv`` (B, T) as nested lists."""
    weights, _, _, _ = ref_weighting(correction, b, cfg)
    out = {}
    for i, row in enumerate(b["mask"]):
        pos = [t for t, m in enumerate(row) if m > 0]
        log_r = {t: b["logp"][i][t] - b["prox"][i][t] for t in pos}
        s_i = math.exp(sum(log_r.values()) / len(pos)) if pos else 1.0
        for t in pos:
            (w,) = weights[i, t]  # off the thresholds: one weight (assumed by the caller)
            if loss_name == "policy_gradient":
                out[i, t] = (-w * adv[i][t], {-w * adv[i][t]})
                continue
            ratio = s_i if loss_name == "gspo" else math.exp(log_r[t])
            j, dj, _, _ = ref_clipped_objective(ratio, adv[i][t], loss_cfg.clip_low, loss_cfg.clip_high, None)
            out[i, t] = (-w * j, {-w * g for g in dj})
    return out


@pytest.mark.parametrize("loss_name", RATIO_LOSSES)
@pytest.mark.parametrize("correction", WEIGHTING)
@SETTINGS
@given(case=behaviour_batches(min_b=2), data=st.data())
def test_a_ratio_loss_clips_pi_over_prox_and_weights_prox_over_mu_once(correction, loss_name, case, data):
    """A mini-batch step of the learner (objective.prepare_batch + minibatch_loss, pi_prox the policy at
    the step's start) with a weighting correction under a ratio loss is the papers' composition
    w(pi_prox / mu) * min(r A, clip(r) A), r = pi / pi_prox (never w(pi / mu) with r = pi / mu)."""
    b, cfg = case
    mask = b["mask"]
    assume(mask.sum() > 0)
    b = dict(b, prox=b["prox"] if b["prox"] is not None else np.where(mask > 0, b["logp"], NAN))
    weights, _, _, _ = ref_weighting(correction, as_lists(b), cfg)
    assume(all(len(w) == 1 for w in weights.values()))  # off the rejection thresholds
    rewards = data.draw(hnp.arrays(np.float64, (len(mask),), elements=floats(-1, 1)))
    loss_cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28)
    preset = dataclasses.replace(
        PRESETS["grpo"],
        policy_loss=loss_name,
        correction=correction,
        kl_coef=0.0,
        aggregation="token-mean",
        correction_config=cfg,
        loss_config=loss_cfg,
    )
    batch = StepBatch(torch.tensor(rewards), torch.arange(len(mask)) // 2, torch.tensor(mask), torch.tensor(b["mu"]))
    lp = torch.tensor(b["logp"], requires_grad=True)
    inputs = prepare_batch(preset, batch, torch.tensor(b["prox"]), Reducer())
    out = minibatch_loss(preset, batch, inputs, lp, Reducer(), ranks=1, max_len=float(mask.shape[1]))
    out.policy_loss.backward()

    n_tok = float(mask.sum())
    want = ref_composed_loss(loss_name, correction, as_lists(b), inputs.advantages.tolist(), cfg, loss_cfg)
    assert close(out.policy_loss.item(), sum(v[0] for v in want.values()) / n_tok)
    for (i, t), (_, grads) in want.items():
        got = float(lp.grad[i, t])
        assert any(close(got, g / n_tok) for g in grads), (i, t, got, [g / n_tok for g in grads])


@pytest.mark.parametrize("loss_name", RATIO_LOSSES)
@pytest.mark.parametrize(("pi", "want_loss", "want_grad"), [(0.55, -0.05, -0.55), (0.75, -0.25, -0.75)])
def test_grpo_with_token_tis_applies_the_weight_once(loss_name, pi, want_loss, want_grad):
    """The issue's example: two one-token rows of one group, R = [1, 0] (A = [1, -1]), mu = 0.5; row 0 has
    pi = 0.55 (rho 1.1) or 0.75 (rho 1.5), row 1 is on-policy. One optimizer step (pi_prox = pi, r = 1):
    l_0 = -min(rho, C) A. Weighting by pi / mu AND anchoring the ratio on mu once gave -0.105 and -0.605
    (rho 1.1), and a zero gradient at rho 1.5 (the ratio clipped around mu)."""
    preset = dataclasses.replace(PRESETS["grpo" if loss_name == "ppo_clip" else "gspo"], correction="tis", kl_coef=0.0)
    lp = torch.log(torch.tensor([[pi], [0.5]], dtype=torch.float64)).requires_grad_()
    mu = torch.log(torch.full((2, 1), 0.5, dtype=torch.float64))
    batch = StepBatch(
        torch.tensor([1.0, 0.0], dtype=torch.float64), torch.zeros(2, dtype=torch.long), torch.ones(2, 1), mu
    )
    out = step_loss(preset, batch, lp, Reducer(), ranks=1, max_len=1.0)
    out.policy_loss.backward()
    assert out.policy_loss.item() == pytest.approx(want_loss, abs=1e-5)
    assert lp.grad[:, 0].tolist() == pytest.approx([want_grad, 0.5], abs=1e-5)


@pytest.mark.parametrize("loss_name", ["policy_gradient", *RATIO_LOSSES])
@pytest.mark.parametrize("correction", [*WEIGHTING, "none"])
@SETTINGS
@given(case=behaviour_batches(), data=st.data())
def test_one_step_per_batch_is_the_weighted_policy_gradient(correction, loss_name, case, data):
    """objective.step_loss (one optimizer step: pi_prox = sg(pi), r = 1) with any weighting correction
    and any policy loss is -w A grad log pi with w the correction's weight at pi: token TIS, IcePop, ...
    (the learner's original loss for tis). ``none`` under a ratio loss stays anchored on mu."""
    b, cfg = case
    mask = b["mask"]
    assume(mask.sum() > 0)
    b = dict(b, prox=np.where(mask > 0, b["logp"], NAN))
    weights, _, _, _ = ref_weighting(correction, as_lists(b), cfg)
    assume(all(len(w) == 1 for w in weights.values()))
    adv = data.draw(hnp.arrays(np.float64, (len(mask),), elements=floats(-3, 3)))
    preset = dataclasses.replace(
        PRESETS["dr_grpo"],
        policy_loss=loss_name,
        correction=correction,
        aggregation="token-mean",
        correction_config=cfg,
        loss_config=PolicyLossConfig(),
    )
    # dr_grpo's A_i = R_i - mean_g R: one sequence per group gives A = 0, so pair each row with a twin
    # whose reward is -R_i (A_i = R_i) and whose mask is empty
    batch = StepBatch(
        torch.tensor(np.concatenate([adv, -adv])),
        torch.arange(len(mask)).repeat(2),
        torch.tensor(np.concatenate([mask, np.zeros_like(mask)])),
        torch.tensor(np.concatenate([b["mu"], b["mu"]])),
    )
    lp = torch.tensor(np.concatenate([b["logp"], b["logp"]]), requires_grad=True)
    out = step_loss(preset, batch, lp, Reducer(), ranks=1, max_len=float(mask.shape[1]))
    out.policy_loss.backward()
    n_tok = float(mask.sum())
    adv_bt = np.repeat(adv[:, None], mask.shape[1], axis=1).tolist()
    if correction == "none" and loss_name != "policy_gradient":  # plain PPO on behaviour data: r = pi / mu
        want = ref_composed_loss(
            loss_name, "none", dict(as_lists(b), prox=b["mu"].tolist()), adv_bt, cfg, PolicyLossConfig()
        )
    else:
        want = ref_composed_loss("policy_gradient", correction, as_lists(b), adv_bt, cfg, PolicyLossConfig())
    assert close(out.policy_loss.item(), sum(v[0] for v in want.values()) / n_tok)
    for (i, t), (_, grads) in want.items():
        got = float(lp.grad[i, t])
        assert any(close(got, g / n_tok) for g in grads), (i, t, got, [g / n_tok for g in grads])
    assert float(lp.grad[len(mask) :].abs().sum()) == 0.0


def test_missing_inputs_fail_clearly():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="prox_logprobs"):
        get_correction("decoupled_ppo")(CorrectionInput(x, x, torch.ones(2, 3)), CorrectionConfig())
    with pytest.raises(ValueError, match="rewards"):
        get_correction("vtrace")(CorrectionInput(x, x, torch.ones(2, 3)), CorrectionConfig())
    with pytest.raises(ValueError, match="bootstrap_value"):
        CorrectionInput(x, x, x, bootstrap_value=torch.zeros(3))
    with pytest.raises(ValueError, match="icepop"):
        CorrectionConfig(icepop_low=2.0, icepop_high=1.0)
    with pytest.raises(UserError, match="unknown correction 'is'.*decoupled_ppo, geo_mask, icepop, none"):
        get_correction("is")


def test_long_sequence_ratio_metric_stays_finite():
    lp = torch.zeros(1, 400, dtype=torch.float64)
    out = get_correction("seq_tis")(CorrectionInput(lp, lp - 1.0, torch.ones(1, 400)), CorrectionConfig())
    assert out.weights[0, 0].item() == pytest.approx(2.0) and math.isfinite(out.ratio_max)


# ----------------------------------------------------------------------------- presets


def test_preset_table():
    assert set(PRESETS) == {"ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "gspo"}
    got = {n: (p.advantage, p.policy_loss, p.aggregation, p.correction, p.kl_placement) for n, p in PRESETS.items()}
    assert got == {
        "ppo": ("gae", "ppo_clip", "token-mean", "decoupled_ppo", "reward"),
        "grpo": ("grpo", "ppo_clip", "seq-mean-token-mean", "decoupled_ppo", "loss"),
        "dr_grpo": ("dr_grpo", "ppo_clip", "seq-mean-token-sum", "decoupled_ppo", "none"),
        "rloo": ("rloo", "policy_gradient", "token-mean", "tis", "reward"),
        "reinforce_pp": ("reinforce_pp", "ppo_clip", "token-mean", "decoupled_ppo", "reward"),
        "reinforce_pp_baseline": ("reinforce_pp_baseline", "ppo_clip", "token-mean", "decoupled_ppo", "loss"),
        "dapo": ("grpo", "ppo_clip", "token-mean", "decoupled_ppo", "none"),
        "gspo": ("grpo", "gspo", "seq-mean-token-mean", "none", "none"),
    }
    assert (PRESETS["ppo"].loss_config.clip_low, PRESETS["ppo"].loss_config.clip_high) == (0.2, 0.2)
    assert (PRESETS["dapo"].loss_config.clip_low, PRESETS["dapo"].loss_config.clip_high) == (0.2, 0.28)
    assert PRESETS["ppo"].needs_critic and not PRESETS["grpo"].needs_critic
    assert PRESETS["ppo"].required_inputs == {"values", "old_values", "prox_logprobs", "ref_logprobs"}
    assert PRESETS["dr_grpo"].required_inputs == {"group_ids", "prox_logprobs", "max_len"}
    assert PRESETS["gspo"].required_inputs == {"group_ids"}
    # a ratio loss under any correction but none clips pi / pi_prox and weights pi_prox / mu
    for loss in ("ppo_clip", "gspo"):
        for correction in set(CORRECTIONS) - {"none"}:
            p = dataclasses.replace(PRESETS["gspo"], policy_loss=loss, correction=correction)
            assert "prox_logprobs" in p.required_inputs, (loss, correction)
        assert (
            "prox_logprobs"
            not in dataclasses.replace(PRESETS["grpo"], policy_loss=loss, correction="none").required_inputs
        )
    assert PRESETS["rloo"].required_inputs == {"group_ids", "ref_logprobs"}  # policy_gradient + tis: w(pi / mu)


def test_presets_are_frozen_validated_and_overridable():
    grpo = get_preset("grpo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        grpo.kl_coef = 0.0  # type: ignore[misc]
    no_kl = dataclasses.replace(grpo, kl_coef=0.0)
    assert "ref_logprobs" not in no_kl.required_inputs and grpo.kl_coef == 0.04
    with pytest.raises(UserError, match="unknown policy loss 'ppo'"):
        dataclasses.replace(grpo, policy_loss="ppo")
    with pytest.raises(UserError, match="unknown KL placement 'both'"):
        dataclasses.replace(grpo, kl_placement="both")
    with pytest.raises(UserError, match="unknown preset 'a2c'.*dapo, dr_grpo, grpo, gspo, ppo, reinforce_pp"):
        get_preset("a2c")


def preset_loss(p: Preset, b: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How the learner composes a preset's pieces for one batch. Returns (loss, logprobs, values)."""
    lp = torch.tensor(b["logp"], requires_grad=True)
    values = torch.tensor(np.nan_to_num(b["values"]), requires_grad=True)
    mask = torch.tensor(b["mask"])
    kl_in = KLInput(lp, torch.tensor(b["mu"]) - 0.1, mask)  # stands in for the reference model's log-probs
    token_rewards = kl_reward(kl_in, p.kl_estimator, p.kl_coef) if p.kl_placement == "reward" else None
    prox = lp.detach() if "prox_logprobs" in p.required_inputs else None  # one optimizer step per batch
    corr = get_correction(p.correction)(CorrectionInput(lp, torch.tensor(b["mu"]), mask, prox), p.correction_config)
    adv = get_advantage(p.advantage)(
        AdvantageInput(torch.tensor(b["R"]), mask, torch.tensor(b["ids"]), token_rewards, values.detach()),
        p.advantage_config,
    )
    pol = get_policy_loss(p.policy_loss)(
        PolicyLossInput(lp, corr.old_logprobs, adv.advantages, mask, corr.weights), p.loss_config
    )
    token_loss = pol.token_loss
    if p.kl_placement == "loss":
        token_loss = token_loss + kl_loss(kl_in, p.kl_estimator, p.kl_coef)
    counts = LossCounts(float(mask.sum()), float(len(mask)), float(mask.shape[1]))
    loss = aggregate(p.aggregation, token_loss, mask, counts)
    if p.needs_critic:
        critic = value_loss(ValueLossInput(values, values.detach(), adv.returns, mask), p.value_clip)
        loss = loss + p.value_coef * aggregate(p.aggregation, critic.token_loss, mask, counts)
    return loss, lp, values


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_composes_into_a_finite_loss_with_gradient(name):
    rng = np.random.default_rng(0)
    b, t = 8, 6
    mask = (np.arange(t)[None] < rng.integers(1, t + 1, size=(b, 1))).astype(np.float64)
    logp = rng.uniform(-3, -0.1, size=(b, t))
    batch = {
        "logp": logp,
        "mu": logp + rng.normal(0, 0.1, size=(b, t)),
        "mask": mask,
        "values": rng.normal(size=(b, t)),
        "R": np.array([1.0, 0, 0, 1, 1, 1, 0, 1]),
        "ids": np.repeat([0, 1], 4),
    }
    loss, lp, values = preset_loss(PRESETS[name], batch)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(lp.grad).all()
    assert lp.grad.abs().sum() > 0 and (lp.grad[torch.tensor(mask) == 0] == 0).all()
    assert (values.grad is not None and values.grad.abs().sum() > 0) == PRESETS[name].needs_critic
