"""Rollout routing replay in the learner (asyncrl/models/route_replay.py): the forward takes exactly the experts
given where they are given and its own elsewhere, gates renormalised as the router's own, the router still
trained through them; a sample's routes travel on the wire and into the step's batch; the step reports the
mismatch that replay removed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.demo.model import build_model, build_tokenizer
from asyncrl.learners.batching import make_batch
from asyncrl.models.route_replay import RouteReplay, batch_routes
from asyncrl.models.routers import RouterTap, find_routers
from asyncrl.protocol import ProtocolError, Sample, TrajectoryGroup, decode_group, encode_group


def ids_and_mask(rows=3, length=10):
    ids = torch.randint(3, 259, (rows, length), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[2, 7:] = 0  # right padding of the last row
    return ids, mask


def own_routes(model, ids, mask) -> torch.Tensor:
    """(B * L, layers, top_k) the model's own expert choices on every position."""
    seen = []
    hooks = [r.register_forward_hook(lambda m, i, out: seen.append(out[2])) for r in find_routers(model)]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    return torch.stack(seen, 1)


def logprobs(model, ids, mask) -> torch.Tensor:
    return torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)


def other_experts(routes: torch.Tensor, experts: int = 8) -> torch.Tensor:
    """Routes with every token-layer sent to two experts it did not choose."""
    out = routes.clone()
    for k in range(routes.shape[-1]):
        candidate = (routes.max(-1).values + 1 + k) % experts
        clash = (candidate[..., None] == routes).any(-1)
        out[..., k] = torch.where(clash, (candidate + 3) % experts, candidate)
    assert not (out[..., :1] == out[..., 1:]).any()
    return out


def test_replaying_the_models_own_routes_changes_nothing(moe):
    ids, mask = ids_and_mask()
    replay = RouteReplay(moe)
    own = own_routes(moe, ids, mask)
    with torch.no_grad():
        plain = logprobs(moe, ids, mask)
        with replay.using(own):
            again = logprobs(moe, ids, mask)
    assert torch.equal(plain, again)
    assert replay.given == own.shape[0] * 2 and replay.differ == 0


def test_the_forward_takes_the_given_experts_where_given_and_its_own_elsewhere(moe):
    ids, mask = ids_and_mask()
    own = own_routes(moe, ids, mask)
    given = other_experts(own)
    given[::3] = -1  # every third position keeps the learner's routing
    tap, replay = RouterTap(moe), RouteReplay(moe)  # the tap first: replay's hook still runs before it
    with torch.no_grad(), tap, replay.using(given):
        moved = logprobs(moe, ids, mask)
    real = mask.flatten().bool()
    want = torch.where((given >= 0).all(-1, keepdim=True), given, own)
    for layer, chosen in enumerate(tap.choices):  # what the forward used, as the router metrics see it
        assert torch.equal(chosen.sort(-1).values, want[real, layer].sort(-1).values)
    known = int((given[:, 0, 0] >= 0).sum())  # positions
    assert replay.given == 2 * known and replay.differ == 2 * known  # each given token-layer differs here
    with torch.no_grad():
        assert (moved - logprobs(moe, ids, mask)).abs().max() > 1e-2  # other experts: other log-probs


def test_the_gates_are_the_routers_probabilities_of_the_given_experts_renormalised(moe):
    router = find_routers(moe)[0]
    hidden = torch.randn(5, router.weight.shape[1], generator=torch.Generator().manual_seed(3))
    given = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 6]])
    replay = RouteReplay(moe)
    routes = torch.stack([given, given], 1)
    with replay.using(routes):
        logits, gates, experts = router(hidden)
    probs = torch.softmax(hidden @ router.weight.T, -1).gather(-1, given)
    assert torch.equal(experts, given)
    assert torch.allclose(gates, probs / probs.sum(-1, keepdim=True), atol=1e-6)


def test_the_router_learns_through_the_replayed_gates(moe):
    ids, mask = ids_and_mask()
    replay, routers = RouteReplay(moe), find_routers(moe)
    given = other_experts(own_routes(moe, ids, mask))
    moe.zero_grad()
    with replay.using(given):
        logprobs(moe, ids, mask)[..., 5].sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers)
    moe.zero_grad()


def test_routes_of_a_wrong_shape_are_refused(moe):
    ids, mask = ids_and_mask()
    replay = RouteReplay(moe)
    with pytest.raises(ValueError, match="1 layers, but the model has 2 routers"):
        with replay.using(torch.zeros(30, 1, 2, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="routes of shape"), replay.using(torch.zeros(7, 2, 2, dtype=torch.long)):
        moe(input_ids=ids, attention_mask=mask)


def test_a_dense_model_has_nothing_to_replay():
    assert not RouteReplay(build_model(build_tokenizer()))


def group(routes: list) -> TrajectoryGroup:
    samples = [
        Sample(np.array([5, 6, 7], np.int32), np.zeros(3, np.float32), np.zeros(3, np.int32), 1.0, routes=r)
        for r in routes
    ]
    return TrajectoryGroup(np.array([1, 2], np.int32), samples, prompt_index=0, epoch=0, producer="g")


def test_a_samples_routes_travel_on_the_wire_and_into_the_batch():
    from asyncrl.config import AlgorithmConfig
    from asyncrl.config.presets import from_config

    rng = np.random.default_rng(0)
    full = rng.integers(0, 8, (4, 2, 2), dtype=np.uint8)  # prompt 2 + tokens 3: all but the last position
    back = decode_group(encode_group(group([full, None])))
    assert np.array_equal(back.samples[0].routes, full) and back.samples[1].routes is None
    batch = make_batch([back], 8, from_config(AlgorithmConfig()), pad_id=0, version=0)
    assert batch["routes"].shape == (2, 5, 2, 2)
    assert torch.equal(batch["routes"][0, :4], torch.from_numpy(full.astype(np.int64)))
    assert (batch["routes"][0, 4] == -1).all() and (batch["routes"][1] == -1).all()
    assert "routes" not in make_batch([group([None])], 8, from_config(AlgorithmConfig()), pad_id=0, version=0)


def test_routes_longer_than_their_sample_or_of_another_type_are_refused():
    with pytest.raises(ProtocolError, match="more positions"):
        decode_group(encode_group(group([np.zeros((6, 2, 2), np.uint8)])))
    with pytest.raises(ProtocolError, match="uint8"):
        decode_group(encode_group(group([np.zeros((4, 2), np.uint8)])))
    with pytest.raises(ValueError, match="routes"):
        batch_routes([np.zeros((4, 3, 2), np.uint8)], [5], 6, 2, 2)


def test_the_step_reports_the_mismatch_replay_removed_summed_over_ranks(moe):
    from asyncrl.learners.train_step import Models, replay_metrics

    class Summed:
        def sum(self, values):
            return [2 * v for v in values]

    ids, mask = ids_and_mask()
    own = own_routes(moe, ids, mask)
    given = own.clone()
    given[:6, 1] = other_experts(own[:6])[:, 1]  # 6 positions of the last layer (so no later choice moves)
    given[-3:] = -1  # the padded row's last 3 positions: no routes
    models = Models(moe, routers=RouterTap(moe))
    batch = {"routes": given.reshape(3, 10, 2, 2), "attention_mask": mask}
    with torch.no_grad(), models.replay.using(given):
        moe(input_ids=ids, attention_mask=mask)
    metrics = replay_metrics(models.replay, batch, Summed())
    assert metrics["learner/routing_replay_diff"] == pytest.approx(6 / (27 * 2))
    assert metrics["learner/routing_replayed"] == pytest.approx(27 / 27)
