"""Advantage estimators against slow references written loop by loop in the papers' notation.

The estimators run in float64 and float32 (the learner's dtype); the references in float64 on the same
(rounded) inputs. Estimators compute in float64 internally and return the input dtype.

Notation: sequence i has outcome reward R_i, extra per-token rewards e_{i,t} (a folded KL penalty),
critic values V_{i,t}; its steps k = 1..n_i are its response positions in order (padding skipped);
group g = the sequences sharing a prompt id (ragged, in any order).

    r_{i,k}   = e_{i,k} + R_i [k = n_i]
    GAE       delta_k = r_k + gamma V_{k+1} - V_k (V_{n+1} = 0);  A_k = sum_j (gamma lam)^j delta_{k+j};  ret = A + V
    GRPO      A_i = (S_i - mean_g S) / (std_g S + eps),  S_i = R_i + sum_k e_{i,k}   (Dr.GRPO: no division)
    RLOO      A_i = S_i - (1/(n_g - 1)) sum_{j in g, j != i} S_j   (0 for a group of one)
    R++       G_k = sum_j gamma^j r_{k+j};  A = (G - mean_batch G) / (std_batch G + eps)
    R++-base  the same with R_i replaced by R_i - mean_g R
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algo_common import DTYPES, NAN, SETTINGS, TOL, close, floats, rounded
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from asyncrl.errors import UserError
from asyncrl.learners.advantages import (
    ADVANTAGES,
    AdvantageConfig,
    AdvantageInput,
    get_advantage,
    masked_moments,
    token_level_rewards,
)

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- slow references


def steps(mask_row) -> list[int]:
    return [t for t, m in enumerate(mask_row) if m > 0]


def ref_token_rewards(batch, i, centred_reward=None) -> list[float]:
    pos = steps(batch["mask"][i])
    reward = batch["rewards"][i] if centred_reward is None else centred_reward
    extra = batch["token_rewards"]
    r = [extra[i][t] if extra is not None else 0.0 for t in pos]
    if pos:
        r[-1] += reward
    return r


def ref_groups(batch) -> dict:
    groups: dict = {}
    for i, g in enumerate(batch["group_ids"]):
        groups.setdefault(g, []).append(i)
    return groups


def ref_mean_std(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    mean = 0.0
    for x in xs:
        mean += x / n
    var = 0.0
    for x in xs:
        var += (x - mean) ** 2 / n  # population variance
    return mean, math.sqrt(var)


def ref_scores(batch) -> list[float]:
    """S_i = R_i + sum_k e_{i,k}."""
    rewards = batch["rewards"]
    return [rewards[i] + sum(ref_token_rewards(batch, i, centred_reward=0.0)) for i in range(len(rewards))]


def ref_group_estimator(batch, cfg, kind: str):
    scores = ref_scores(batch)
    adv = [0.0] * len(scores)
    for members in ref_groups(batch).values():
        s = [scores[j] for j in members]
        mean, std = ref_mean_std(s)
        n = len(members)
        for j in members:
            if kind == "grpo":
                adv[j] = (scores[j] - mean) / (std + cfg.eps)
            elif kind == "dr_grpo":
                adv[j] = scores[j] - mean
            else:  # rloo: leave-one-out mean of the others
                others = [scores[k] for k in members if k != j]
                adv[j] = scores[j] - sum(others) / len(others) if n > 1 else 0.0
    return [[adv[i]] * len(steps(batch["mask"][i])) for i in range(len(scores))], None


def ref_gae(batch, cfg):
    advs, rets = [], []
    for i in range(len(batch["rewards"])):
        pos = steps(batch["mask"][i])
        r = ref_token_rewards(batch, i)
        v = [batch["values"][i][t] for t in pos] + [0.0]  # terminal: V after the last step = 0
        n = len(pos)
        delta = [r[k] + cfg.gamma * v[k + 1] - v[k] for k in range(n)]
        a = [sum((cfg.gamma * cfg.lam) ** j * delta[k + j] for j in range(n - k)) for k in range(n)]
        advs.append(a)
        rets.append([a[k] + v[k] for k in range(n)])
    return advs, rets


def ref_reinforce_pp(batch, cfg, baseline: bool):
    centred = [None] * len(batch["rewards"])
    if baseline:
        for members in ref_groups(batch).values():
            mean, _ = ref_mean_std([batch["rewards"][j] for j in members])
            for j in members:
                centred[j] = batch["rewards"][j] - mean
    rets = []
    for i in range(len(batch["rewards"])):
        r = ref_token_rewards(batch, i, centred[i])
        n = len(r)
        rets.append([sum(cfg.gamma**j * r[k + j] for j in range(n - k)) for k in range(n)])
    flat = [g for row in rets for g in row]
    mean, std = ref_mean_std(flat) if flat else (0.0, 0.0)
    return [[(g - mean) / (std + cfg.eps) for g in row] for row in rets], rets


REFERENCES = {
    "gae": ref_gae,
    "grpo": lambda b, c: ref_group_estimator(b, c, "grpo"),
    "dr_grpo": lambda b, c: ref_group_estimator(b, c, "dr_grpo"),
    "rloo": lambda b, c: ref_group_estimator(b, c, "rloo"),
    "reinforce_pp": lambda b, c: ref_reinforce_pp(b, c, baseline=False),
    "reinforce_pp_baseline": lambda b, c: ref_reinforce_pp(b, c, baseline=True),
}


# ----------------------------------------------------------------------------- strategies


def reward_row(draw, n: int) -> list[float]:
    kind = draw(st.sampled_from(["equal", "binary", "real"]))
    if kind == "equal":
        return [draw(floats(-3, 3))] * n
    if kind == "binary":
        return [float(draw(st.integers(0, 1))) for _ in range(n)]
    return [draw(floats(-3, 3)) for _ in range(n)]


@st.composite
def advantage_batches(draw, with_token_rewards: bool | None = None):
    """Ragged groups in shuffled order, response windows anywhere in a row, NaN in padded slots."""
    sizes = [draw(st.integers(1, 5)) for _ in range(draw(st.integers(1, 4)))]
    labels = draw(st.lists(st.integers(0, 99), min_size=len(sizes), max_size=len(sizes), unique=True))
    rewards, ids = [], []
    for label, n in zip(labels, sizes, strict=True):
        rewards += reward_row(draw, n)
        ids += [label] * n
    order = draw(st.permutations(range(len(ids))))
    rewards, ids = [rewards[j] for j in order], [ids[j] for j in order]
    b, t = len(ids), draw(st.integers(1, 7))
    mask = np.zeros((b, t))
    for i in range(b):
        start = draw(st.integers(0, t))
        mask[i, start : start + draw(st.integers(0, t - start))] = 1.0
    values = np.where(mask > 0, draw(hnp.arrays(np.float64, (b, t), elements=floats(-2, 2))), NAN)
    if with_token_rewards is None:
        with_token_rewards = draw(st.booleans())
    token_rewards = None
    if with_token_rewards:
        token_rewards = np.where(mask > 0, draw(hnp.arrays(np.float64, (b, t), elements=floats(-1, 1))), NAN)
    cfg = AdvantageConfig(gamma=draw(floats(0, 1)), lam=draw(floats(0, 1)), eps=draw(floats(1e-6, 1e-2)))
    return {"rewards": rewards, "group_ids": ids, "mask": mask, "values": values, "token_rewards": token_rewards}, cfg


def make_input(batch, dtype: torch.dtype = torch.float64, **overrides) -> AdvantageInput:
    tr = batch["token_rewards"]
    fields = {
        "rewards": torch.tensor(batch["rewards"], dtype=dtype),
        "mask": torch.tensor(batch["mask"], dtype=dtype),
        "group_ids": torch.tensor(batch["group_ids"]),
        "token_rewards": None if tr is None else torch.tensor(tr, dtype=dtype),
        "values": torch.tensor(batch["values"], dtype=dtype),
    }
    fields.update(overrides)
    return AdvantageInput(**fields)


def rounded_batch(batch, dtype: torch.dtype) -> dict:
    """The batch as a dtype learner holds it (for the float64 reference)."""
    rewards = [float(r) for r in rounded(np.asarray(batch["rewards"]), dtype)]
    return dict(batch, rewards=rewards, **{k: rounded(batch[k], dtype) for k in ("values", "token_rewards")})


def assert_rows(got: torch.Tensor, want: list[list[float]], mask, dtype: torch.dtype = torch.float64) -> None:
    for i, row in enumerate(want):
        pos = steps(mask[i])
        assert len(pos) == len(row)
        for t in range(got.shape[1]):
            if t not in pos:
                assert float(got[i, t]) == 0.0, (i, t)  # exactly 0 off the response, despite NaN junk
        for k, value in enumerate(row):
            assert close(float(got[i, pos[k]]), value, dtype=dtype), (i, pos[k], float(got[i, pos[k]]), value)


# ----------------------------------------------------------------------------- estimators vs references


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(ADVANTAGES))
@SETTINGS
@given(case=advantage_batches())
def test_estimator_matches_loop(name, dtype, case):
    batch, cfg = case
    values = torch.tensor(batch["values"], dtype=dtype, requires_grad=True)
    out = get_advantage(name)(make_input(batch, dtype, values=values), cfg)
    want_adv, want_ret = REFERENCES[name](rounded_batch(batch, dtype), cfg)
    assert out.advantages.shape == batch["mask"].shape and not out.advantages.requires_grad
    assert out.advantages.dtype == dtype
    assert_rows(out.advantages, want_adv, batch["mask"], dtype)
    assert (out.returns is None) == (want_ret is None)
    if want_ret is not None:
        assert out.returns.dtype == dtype
        assert_rows(out.returns, want_ret, batch["mask"], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(case=advantage_batches(with_token_rewards=False))
def test_all_equal_groups_get_zero_advantage(dtype, case):
    """Exactly 0, in every dtype: a flat group carries no signal, whatever its rewards' rounding."""
    batch, cfg = case
    inp = make_input(batch, dtype)
    rewards = rounded_batch(batch, dtype)["rewards"]
    for name in ("grpo", "dr_grpo", "rloo"):
        adv = get_advantage(name)(inp, cfg).advantages
        for members in ref_groups(batch).values():
            if len({rewards[j] for j in members}) == 1:
                assert float(adv[members].abs().max()) == 0.0, name
    # every group flat -> the baseline variant carries no signal anywhere
    flat = dict(batch, rewards=[0.1 * g + 0.7 for g in batch["group_ids"]])
    adv = get_advantage("reinforce_pp_baseline")(make_input(flat, dtype), cfg).advantages
    assert float(adv.abs().max()) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("reward", "n"), [(0.7, 8), (2.2, 16), (0.1, 3), (-1.3, 5)])
def test_fractional_all_equal_group_in_float32(reward, n, dtype):
    """The demo's fractional rewards: one flat group (float32 group statistics once gave 0.056 / 0.19)."""
    rewards, mask = torch.full((n,), reward, dtype=dtype), torch.ones(n, 3, dtype=dtype)
    inp = AdvantageInput(rewards, mask, group_ids=torch.zeros(n, dtype=torch.long))
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        adv = get_advantage(name)(inp, AdvantageConfig()).advantages
        assert adv.dtype == dtype and adv.abs().max().item() == 0.0, (name, adv.abs().max().item())
    # one flat batch: REINFORCE++'s batch moments see no spread either (float64 moments)
    adv = get_advantage("reinforce_pp")(inp, AdvantageConfig()).advantages
    assert adv.dtype == dtype and adv.abs().max().item() < 1e-9, adv.abs().max().item()


def test_rloo_examples():
    ids = torch.tensor([0, 0, 0, 1])
    out = get_advantage("rloo")(
        AdvantageInput(torch.tensor([1.0, 0.0, 2.0, 5.0], dtype=torch.float64), torch.ones(4, 1), group_ids=ids),
        AdvantageConfig(),
    )
    assert out.advantages[:, 0].tolist() == [0.0, -1.5, 1.5, 0.0]  # 1 - (0+2)/2, 0 - (1+2)/2, ...; lone sample: 0


@SETTINGS
@given(case=advantage_batches(), data=st.data())
def test_global_moments_make_batch_normalisation_split_invariant(case, data):
    """Whole groups split across two ranks: with moments over the union, each rank gets the full-batch A."""
    batch, cfg = case
    labels = sorted(set(batch["group_ids"]))
    rank0 = set(data.draw(st.lists(st.sampled_from(labels), unique=True)))
    parts = [[i for i, g in enumerate(batch["group_ids"]) if (g in rank0) == side] for side in (True, False)]
    for name in ("reinforce_pp", "reinforce_pp_baseline"):
        full = get_advantage(name)(make_input(batch), cfg)
        returns = full.returns

        def global_moments(x, mask, _r=returns):  # stands in for an all-reduce of the ranks' returns
            return masked_moments(_r, make_input(batch).mask)

        for rows in parts:
            sub = make_input(batch)
            sub = AdvantageInput(
                rewards=sub.rewards[rows],
                mask=sub.mask[rows],
                group_ids=sub.group_ids[rows],
                token_rewards=None if sub.token_rewards is None else sub.token_rewards[rows],
                moments=global_moments,
            )
            got = get_advantage(name)(sub, cfg).advantages
            assert torch.allclose(got, full.advantages[rows], rtol=TOL, atol=TOL)


# ----------------------------------------------------------------------------- helpers, validation, registry


def test_token_level_rewards_places_outcome_on_last_response_token():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    extra = torch.full((3, 4), 0.5)
    got = token_level_rewards(torch.tensor([2.0, 3.0, -1.0]), mask, extra)
    assert got.tolist() == [[0.0, 0.5, 2.5, 0.0], [0.0] * 4, [0.5, 0.0, 0.5, -0.5]]


def test_missing_inputs_and_bad_shapes():
    mask = torch.ones(2, 3)
    r = torch.ones(2)
    with pytest.raises(ValueError, match="values"):
        get_advantage("gae")(AdvantageInput(r, mask), AdvantageConfig())
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        with pytest.raises(ValueError, match="group_ids"):
            get_advantage(name)(AdvantageInput(r, mask), AdvantageConfig())
    with pytest.raises(ValueError, match="rewards"):
        AdvantageInput(torch.ones(3), mask)
    with pytest.raises(ValueError, match="values"):
        AdvantageInput(r, mask, values=torch.ones(2, 4))
    with pytest.raises(ValueError, match="gamma"):
        AdvantageConfig(gamma=1.5)
    with pytest.raises(ValueError, match="eps"):
        AdvantageConfig(eps=0.0)


def test_unknown_estimator_lists_known_names():
    with pytest.raises(UserError, match="unknown advantage estimator 'vtrace'.*dr_grpo, gae, grpo, reinforce_pp"):
        get_advantage("vtrace")
    assert set(ADVANTAGES) == {"gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}
