"""A mixture of experts' routers in the learner (asyncrl/models/routers.py): the tap sees exactly the real tokens'
choices, its load-balancing loss is transformers' own, and the step's metrics add up over ranks."""

from __future__ import annotations

import pytest
import torch

from asyncrl.demo.model import build_model, build_tokenizer
from asyncrl.learners.objective import StepLoss
from asyncrl.models.routers import RouterTap, add_aux_loss, router_metrics, step_router_metrics


def batch(rows=3, length=10, pad=4):
    ids = torch.randint(3, 259, (rows, length), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0  # left padding of the first row
    return ids, mask


class Summed:
    """A reducer over two ranks holding the same values."""

    def sum(self, values):
        return [2 * v for v in values]


def test_the_tap_records_the_real_tokens_choices_of_every_router(moe):
    ids, mask = batch()
    tap = RouterTap(moe)
    assert len(tap.routers) == 2 and tap.top_k == 2 and tap.experts == 8
    seen = []
    hooks = [r.register_forward_hook(lambda m, i, out: seen.append(out[2])) for r in tap.routers]
    with tap:
        moe(input_ids=ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    real = mask.flatten().bool()
    assert len(tap.choices) == 2 and all(c.shape == (int(real.sum()), 2) for c in tap.choices)
    assert all(torch.equal(c, s[real]) for c, s in zip(tap.choices, seen, strict=True))
    moe(input_ids=ids, attention_mask=mask)  # outside ``with``: nothing recorded
    assert len(tap.choices) == 2
    sums = tap.sums()
    assert sums["counts"].sum(1).tolist() == [2.0 * real.sum()] * 2 and sums["tokens"].tolist() == [real.sum()] * 2


def test_the_aux_loss_is_transformers_load_balancing_loss_over_top_k(moe):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    ids, mask = batch(pad=0)
    tap = RouterTap(moe)
    with tap:
        moe(input_ids=ids, attention_mask=mask)
    for layer in range(2):  # one layer at a time: transformers pools the layers' tokens, the tap averages layers
        want = load_balancing_loss_func((tap.logits[layer],), 8, 2) / 2
        one = RouterTap.__new__(RouterTap)
        one.experts, one.logits, one.choices = 8, [tap.logits[layer]], [tap.choices[layer]]
        assert float(one.aux_loss()) == pytest.approx(float(want), rel=1e-5)
    assert tap.aux_loss().requires_grad  # it trains the routers when learner.router_aux_loss_coef > 0
    sums = tap.sums()
    metrics = router_metrics(sums["counts"], sums["probs"], sums["tokens"], 2)
    assert metrics["learner/moe_aux_loss"] == pytest.approx(float(tap.aux_loss()), rel=1e-5)


def test_the_step_gets_the_loss_and_the_metrics_summed_over_ranks(moe):
    ids, mask = batch()
    tap = RouterTap(moe)
    with tap:
        moe(input_ids=ids, attention_mask=mask)
    out = StepLoss(torch.tensor(1.0), None, {})
    add_aux_loss(tap, out, 0.5)
    out.metrics.update(step_router_metrics(tap, Summed()))
    assert float(out.policy_loss) == pytest.approx(1.0 + 0.5 * float(tap.aux_loss()))
    sums = tap.sums()  # two equal ranks: shares, and so every metric, are the one rank's
    assert out.metrics == pytest.approx(router_metrics(sums["counts"], sums["probs"], sums["tokens"], 2))
    load = sums["counts"] / sums["counts"].sum(1, keepdim=True) * 8
    assert out.metrics["learner/moe_load_max"] == pytest.approx(float(load.max()))
    assert out.metrics["learner/moe_load_min"] == pytest.approx(float(load.min()))


def test_a_dense_model_has_no_routers_and_its_step_is_untouched():
    dense = build_model(build_tokenizer())
    tap = RouterTap(dense)
    assert not tap
    with tap:
        dense(input_ids=torch.ones(1, 4, dtype=torch.long))
    out = StepLoss(torch.tensor(1.0), None, {"learner/loss": 1.0})
    add_aux_loss(tap, out, 0.5)
    out.metrics.update(step_router_metrics(tap, Summed()))
    assert out.metrics == {"learner/loss": 1.0} and float(out.policy_loss) == 1.0
