"""Rollout routing replay's engine half in the real vLLM engine (generators/vllm_routes.py), on the demo-sort-moe
model: every sample of an n-sample request, and a request sharing its prompt, ends with one row of experts per
position a forward ran (its prompt's included: prefix caching is off), each the experts transformers' forward
of the same sequence routes to; the learner replaying them scores the engine's log-probs; an aborted
request's rows are forgotten."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_common import start_engine  # noqa: E402

from asyncrl.generators.engine import Sampling  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "demo-sort-moe"


@pytest.fixture(scope="module")
def model_dir():
    from demo_launch import ROOT

    from asyncrl.demo.recipes import prepare_demo_model

    return prepare_demo_model(ROOT / ".cache" / "models" / MODEL, recipe=MODEL)


@pytest.fixture(scope="module")
def engine(model_dir):
    return start_engine(model_dir, routes=True)


def run(engine, requests: dict[str, tuple[list[int], int]]) -> dict:
    """Each request's samples to the end: (request, index) -> (tokens, log-probs, routes)."""
    for rid, (prompt, n) in requests.items():
        engine.add_request(rid, prompt, Sampling(n, 1.0, 1.0, 8))
    out, want = {}, sum(n for _, n in requests.values())
    while sum(1 for v in out.values() if v[3]) < want:
        for o in engine.step():
            tokens, logprobs, _, _ = out.get((o.request_id, o.index), ([], [], None, False))
            out[o.request_id, o.index] = (tokens + o.tokens, logprobs + o.logprobs, o.routes, o.finished)
    return {key: v[:3] for key, v in out.items()}


def own_routes(model, ids: list[int]) -> torch.Tensor:
    """(positions, layers, top_k) transformers' expert choices on ``ids``, each row sorted."""
    from asyncrl.models.routers import find_routers

    seen = []
    hooks = [r.register_forward_hook(lambda m, i, out: seen.append(out[2])) for r in find_routers(model)]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(seen, 1).sort(-1).values


def test_every_sample_carries_the_experts_of_every_position_a_forward_ran(engine, model_dir):
    from transformers import AutoModelForCausalLM

    from asyncrl.learners.batching import model_logprobs
    from asyncrl.models.route_replay import RouteReplay

    assert engine.routes
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = list(range(40, 60))
    samples = run(engine, {"three": (prompt, 3), "same-prompt": (prompt, 1), "short": (prompt[:7], 1)})
    assert len(samples) == 5
    replay = RouteReplay(model)
    for (rid, _), (tokens, logprobs, routes) in samples.items():
        ids = (prompt[:7] if rid == "short" else prompt) + tokens
        assert routes is not None and routes.dtype.name == "uint8"
        assert routes.shape == (len(ids) - 1, 2, 2), rid  # the last token was sampled, never run
        assert torch.equal(torch.from_numpy(routes).long().sort(-1).values, own_routes(model, ids[:-1]))
        # the learner replaying them scores what the engine sampled with
        x = torch.tensor([ids])
        given = torch.full((len(ids), 2, 2), -1, dtype=torch.long)
        given[:-1] = torch.from_numpy(routes).long()
        scored = torch.zeros(1, len(ids) - 1)
        scored[0, len(ids) - len(tokens) - 1 :] = 1
        with torch.no_grad(), replay.using(given):
            learner = model_logprobs(model, x, torch.ones_like(x), 1.0, scored)[0, -len(tokens) :]
        assert learner.tolist() == pytest.approx(logprobs, abs=1e-4)
        assert replay.differ == 0


def test_an_aborted_requests_rows_are_forgotten(engine):
    prompt = list(range(60, 80))
    engine.add_request("gone", prompt, Sampling(2, 1.0, 1.0, 8))
    engine.step()  # its prompt ran
    engine.abort_requests(["gone"])
    samples = run(engine, {"next": (prompt, 1)})
    assert samples["next", 0][2].shape[0] == len(prompt) + len(samples["next", 0][0]) - 1
    held = engine.llm.collective_rpc("asyncrl_take_routes", args=([], []))  # a take drops nothing more
    assert held == [{}]
    assert engine.llm.collective_rpc("asyncrl_routes_held")[0] == 0


def test_a_requests_rows_grow_with_it(engine, model_dir, monkeypatch):
    """Room for 4 positions at first: the prompt's 20 and each sampled token's row still land in place."""
    from transformers import AutoModelForCausalLM

    from asyncrl.generators import vllm_routes

    monkeypatch.setattr(vllm_routes, "FIRST_POSITIONS", 4)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = list(range(80, 100))
    (tokens, _, routes), = run(engine, {"grown": (prompt, 1)}).values()  # fmt: skip
    ids = prompt + tokens
    assert routes.shape == (len(ids) - 1, 2, 2)
    assert torch.equal(torch.from_numpy(routes).long().sort(-1).values, own_routes(model, ids[:-1]))
