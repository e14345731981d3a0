"""Failing episodes through a real generator (transformers engine) on a real redis-server: each
failure ends in its cause and counters, the group in its outcome (``failed`` or pushed with the
failed sample kept), nothing is lost, and past the failure limit the generator stops the run."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from generator_common import make_generator, play_groups

from asyncrl import buffers
from asyncrl.buffers.base import BufferUnavailableError, lost_groups, unfinished_groups
from asyncrl.config import load_config
from asyncrl.control import RunControl, connect
from asyncrl.generators.hf_engine import HfEngine
from asyncrl.keys import run_prefix
from asyncrl.protocol import decode_group
from asyncrl.weights import MemoryWeightBus

pytestmark = pytest.mark.redis

N = 3  # samples per group


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    cfg = load_config(None, {"model.path": str(tiny_model_dir), "model.recipe": None})
    return HfEngine(cfg.model, seed=0)


@pytest.fixture
def generator(tmp_path, tiny_model_dir, engine, redis_server):
    made = []

    def make(**overrides):
        train = tmp_path / "train.jsonl"
        prompts = ["sort:cba=", "sort:dcb=", "sort:fed="]
        train.write_text("".join(json.dumps({"prompt": p, "answer": "abc"}) + "\n" for p in prompts))
        settings = {
            "model.path": str(tiny_model_dir),
            "model.recipe": None,
            "generator.engine.type": "hf",
            "generator.n_samples": N,
            "generator.max_new_tokens": 4,
            "data.train": str(train),
            "data.eval": None,
            "data.reward": "asyncrl.demo.sort:reward",
            "learner.groups_per_step": 2,
            "run.max_policy_lag": 8,
            "run.learners": 1,
            "episode.step_timeout_s": 0.3,
            "episode.reward_timeout_s": 0.3,
            **overrides,
        }
        cfg = load_config(None, settings)
        prefix = run_prefix(f"fail-{uuid.uuid4().hex[:8]}")
        control = RunControl(connect(redis_server.url), prefix)
        buffer = buffers.setup(cfg.buffer, redis_server.url, prefix)
        made.append(buffer)
        sub = MemoryWeightBus().subscriber("generator-0", have=0)
        return make_generator(cfg, engine, control, sub, tiny_model_dir, buffer)

    yield make
    for buffer in made:
        buffer.close()


def claim(gen, n: int) -> list[int]:
    return [gen.buffer.try_start_group(0, 8, 2) for _ in range(n)]


def failures(gen) -> dict[str, int]:
    return dict(gen.stats.failures)


def assert_accounted(gen) -> dict:
    counts = gen.buffer.stats()
    assert lost_groups(counts) == 0 and unfinished_groups(counts) == 0, counts
    return counts


@pytest.mark.parametrize(
    ("overrides", "cause"),
    [
        ({"episode.function": "episode_fixtures:RaisingEnv", "episode.options": {"every": 1}}, "env_error"),
        ({"episode.function": "episode_fixtures:HangingEnv"}, "env_timeout"),
        ({"data.reward": "episode_fixtures:reward_always_raises"}, "reward_error"),
        ({"data.reward": "episode_fixtures:reward_hangs"}, "reward_timeout"),
        ({"data.reward": "episode_fixtures:reward_nan"}, "reward_invalid"),
        ({"episode.function": "episode_fixtures:runaway", "episode.max_tokens": 12}, "budget"),
        # no reward server there: connect errors, retried, then an error (the timeout leaves room for the retries)
        ({"data.reward": "http://:secret@127.0.0.1:9/score", "episode.reward_timeout_s": 10}, "reward_error"),
    ],
)
def test_every_failure_ends_its_group_as_failed_under_drop_group(generator, overrides, cause):
    gen = generator(**overrides)
    play_groups(gen, claim(gen, 2))
    assert failures(gen) == {cause: 2 * N}
    counts = assert_accounted(gen)
    assert counts["failed"] == 2 and counts["pushed"] == 0
    assert gen.buffer.read("rank0", 10, 0) == []


def test_zero_sample_keeps_the_failed_sample_and_the_learner_leaves_it_out(generator):
    gen = generator(
        **{
            "episode.function": "episode_fixtures:RaisingEnv",
            "episode.options": {"every": 2},
            "episode.failure_policy": "zero_sample",
        }
    )
    play_groups(gen, claim(gen, 4))
    counts = assert_accounted(gen)
    groups = [decode_group(e.frame) for e in gen.buffer.read("rank0", 10, 0)]
    statuses = [s.status for g in groups for s in g.samples]
    assert counts["pushed"] + counts["failed"] == 4 and counts["pushed"] >= 1
    assert statuses.count("env_error") >= 1 and "ok" in statuses
    assert sum(failures(gen).values()) == statuses.count("env_error") + N * counts["failed"]
    for g in groups:
        kept = g.trainable()
        assert kept.samples and all(s.status == "ok" for s in kept.samples)


def test_tool_failures_are_counted_and_the_episode_goes_on(generator):
    gen = generator(**{"episode.tools": ["episode_fixtures:broken", "episode_fixtures:stuck"]})
    play_groups(gen, claim(gen, 1))
    # the untrained model calls no tool: this checks the loop runs; the unit tests drive the calls
    assert assert_accounted(gen)["pushed"] == 1


def test_the_run_goes_on_when_some_episodes_fail(generator):
    gen = generator(**{"episode.function": "episode_fixtures:RaisingEnv", "episode.options": {"every": 3}})
    play_groups(gen, claim(gen, 6))
    counts = assert_accounted(gen)
    assert counts["pushed"] >= 1 and counts["failed"] >= 1
    record = gen.stats.record(0, None)
    assert record["episodes/failed_env_error"] == sum(failures(gen).values()) > 0
    assert record["episodes/done"] == 6 * N


def test_past_the_failure_limit_the_generator_stops_the_run_with_the_cause(generator):
    gen = generator(**{"data.reward": "episode_fixtures:reward_string", "episode.failure_window": 9, "run.steps": 1000})
    asyncio.run(gen.run())  # returns: the generator stopped the run
    fatal = gen.control.get_meta("fatal")
    assert gen.control.stop_requested() and fatal is not None
    assert "episodes failed" in fatal and "reward_invalid" in fatal and "str" in fatal
    assert_accounted(gen)  # the groups it had in flight went back as abandoned


def test_an_infrastructure_error_ends_the_generator_not_an_episode(generator):
    """What escapes a group (the buffer gone) is no episode's failure: the loop raises it, and the
    launcher restarts the generator."""
    gen = generator(**{"run.steps": 1000})

    def unreachable(*args, **kwargs):
        raise BufferUnavailableError("redis at 127.0.0.1:1 stayed unreachable")

    gen.buffer.push = unreachable
    with pytest.raises(BufferUnavailableError, match="unreachable"):
        asyncio.run(gen.run())
    assert gen.failures.last_failure is None  # no episode was failed for it


def test_a_generator_joins_the_fleet_only_once_its_episode_code_is_loaded(generator, monkeypatch):
    """User code slow to import (the Agents SDK took longer than a lease's life on a busy machine) runs before
    the generator is a member: its lease starts when it can renew it."""
    from asyncrl.generators import generator as module

    order = []
    load, join = module.load_episode, RunControl.join
    monkeypatch.setattr(module, "load_episode", lambda ep: order.append("load") or load(ep))
    monkeypatch.setattr(RunControl, "join", lambda self, *a, **k: order.append("join") or join(self, *a, **k))
    gen = generator()
    assert order == ["load", "join"]
    assert list(gen.control.members("generator")) == ["0"]
