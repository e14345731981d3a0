"""OpenEnv servers as asyncrl environments (``asyncrl.episodes.openenv``), against a real OpenEnv server:
``openenv_guess``'s environment served by openenv-core's own app under uvicorn, in its own process.

Driven directly (the protocol, one session per episode, every failure's cause) and end to end through
a generator (transformers engine, the test's redis-server) whose ``episode.function`` is
``OpenEnvEnv``: the samples carry the server's observations (mask 0) and its rewards, and a server
killed mid-run fails its episodes as ``env_error`` without a hang or a crash of the generator.

openenv-core is an optional install (``pip install --no-deps openenv-core==0.3.0`` and its server's
few dependencies): missing, these tests skip on a laptop and FAIL under CI (``CI=true``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from services import in_ci

from asyncrl.episodes.openenv import EchoAdapter, OpenEnvEnv
from asyncrl.errors import EpisodeFailure, UserError

HERE = Path(__file__).parent
ADAPTER = "openenv_guess:GuessAdapter"
N = 3  # samples per group


def require_openenv() -> None:
    """openenv-core's server importable, else skip (a laptop) or fail (CI)."""
    try:
        import openenv.core.env_server  # noqa: F401
    except ImportError as exc:
        msg = (
            f"openenv-core's server is not importable ({exc}): install asyncrl's openenv extra, then "
            "pip install --no-deps openenv-core==0.3.0"
        )
        if in_ci():
            pytest.fail(msg + "; CI=true, so this is a failure, not a skip")
        pytest.skip(msg)


class Server:
    """``openenv_guess``'s app under uvicorn on a loopback socket bound here (no port race)."""

    def __init__(self, tmp: Path, sessions: int, token: str | None, port: int = 0):
        self.log = tmp / f"server-{uuid.uuid4().hex[:6]}.jsonl"
        self.stderr = tmp / f"{self.log.stem}.err"
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a killed server's port, taken again
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "OPENENV_GUESS_TOKEN"}
        env.update(OPENENV_GUESS_LOG=str(self.log), OPENENV_GUESS_SESSIONS=str(sessions))
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
        if token:
            env["OPENENV_GUESS_TOKEN"] = token
        cmd = [sys.executable, "-m", "uvicorn", "--factory", "openenv_guess:make_app", "--fd", str(sock.fileno())]
        with open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen(
                [*cmd, "--log-level", "warning"], pass_fds=[sock.fileno()], env=env, stdout=err, stderr=err
            )
        sock.close()

    def wait_healthy(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the OpenEnv server exited with {self.proc.returncode}: {self.stderr.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        pytest.fail(f"the OpenEnv server at {self.url} was not healthy within {timeout_s} s")

    def records(self, event: str) -> list[dict]:
        from openenv_guess import read_log

        return [r for r in read_log(self.log) if r["event"] == event]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def openenv_server(tmp_path):
    """Factory of servers (``sessions``: their max_concurrent_envs; ``token``: the bearer token their
    handshakes need; ``port``: 0 for a free one); each killed by pid at teardown."""
    require_openenv()
    started: list[Server] = []

    def start(sessions: int = 64, token: str | None = None, port: int = 0) -> Server:
        started.append(Server(tmp_path, sessions, token, port))
        started[-1].wait_healthy()
        return started[-1]

    yield start
    for server in started:
        server.kill()


def secret_of(seed: int) -> int:
    return random.Random(seed).randrange(10)  # as GuessEnvironment.reset draws it


# ----------------------------------------------------------------------------------- the Env, directly


def test_an_episode_plays_by_the_servers_rules(openenv_server):
    server = openenv_server()

    async def play():
        env = OpenEnvEnv(server.url, adapter=ADAPTER, timeout_s=10)
        assert await env.reset({"prompt": "guess:"}, seed=4) == "0-9?"
        first = await env.step("no digit here")
        last = await env.step(f"it is {secret_of(4)}")
        await env.close()
        return first, last

    (obs, reward, done, info), last = asyncio.run(play())
    assert (obs, reward, done) == ("?;", 0.0, False) and info["observation"] == {"text": "?;"}
    assert last[:3] == ("ok;", 1.0, True)
    closed = wait_for(lambda: server.records("close"), "the session's close")
    assert [(r["steps"], r["reward"]) for r in closed] == [(2, 1.0)]


def test_concurrent_episodes_each_hold_their_own_session(openenv_server):
    """Two episodes stepped in lockstep: each sees its own secret and its own count of tries (the
    one allowed 2 tries ends on its second step, the other goes on), and the server saw two sessions."""
    server = openenv_server()
    seed_a, seed_b = 1, next(s for s in range(2, 100) if secret_of(s) != secret_of(1))

    async def play():
        a, b = (OpenEnvEnv(server.url, adapter=ADAPTER, timeout_s=10) for _ in range(2))
        await asyncio.gather(a.reset({"tries": 2}, seed_a), b.reset({"tries": 5}, seed_b))
        steps = []
        for _ in range(2):  # each guesses the other's secret: right for one of them only if sessions mixed
            steps.append(await asyncio.gather(a.step(str(secret_of(seed_b))), b.step(str(secret_of(seed_a)))))
        last_b = await b.step(str(secret_of(seed_b)))
        await asyncio.gather(a.close(), b.close())
        return steps, last_b

    steps, last_b = asyncio.run(play())
    higher = {True: "hi;", False: "lo;"}
    for (step_a, step_b), n in zip(steps, (1, 2), strict=True):
        assert step_a[:2] == (higher[secret_of(seed_a) > secret_of(seed_b)], 0.25) and step_a[2] is (n == 2)
        assert step_b[:3] == (higher[secret_of(seed_b) > secret_of(seed_a)], 0.25, False)
    assert last_b[:3] == ("ok;", 1.0, True)
    closed = wait_for(lambda: len(server.records("close")) == 2 and server.records("close"), "both closes")
    assert sorted((r["steps"], r["reward"]) for r in closed) == [(2, 0.5), (3, 1.5)]
    assert len({r["episode"] for r in closed}) == 2


def test_the_default_adapter_is_echo_shaped():
    adapter = EchoAdapter()
    assert adapter.action("hi", {}) == {"message": "hi"}
    assert adapter.observation({"echoed_message": "hi", "message_length": 2}) == "hi"
    assert adapter.observation({"text": "x", "n": 1}) == "x"
    assert adapter.observation({"a": "x", "b": "y"}) == '{"a":"x","b":"y"}'


def test_bad_options_are_user_errors(monkeypatch):
    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    with pytest.raises(UserError, match="'envs:8000' is not an http"):
        OpenEnvEnv("envs:8000")
    with pytest.raises(UserError, match="'ftp://envs:8000' is not an http"):  # named without its token
        OpenEnvEnv("ftp://:sekrit@envs:8000")
    with pytest.raises(UserError, match="'json:dumps' has no action"):
        OpenEnvEnv("http://envs:8000", adapter="json:dumps")
    with pytest.raises(UserError, match=r"\$NO_SUCH_TOKEN, which is not set"):
        OpenEnvEnv("http://envs:8000", token_env="NO_SUCH_TOKEN")
    assert OpenEnvEnv("https://:tok@envs.example/a/").url == "wss://envs.example/a/ws"  # no token in it


def failure(coro_fn) -> EpisodeFailure:
    with pytest.raises(EpisodeFailure) as info:
        asyncio.run(coro_fn())
    return info.value


def test_failures_name_the_server_and_their_cause(openenv_server):
    server = openenv_server()
    with socket.socket() as s:  # bound, never listening: refused
        s.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{s.getsockname()[1]}"
        unreachable = failure(lambda: OpenEnvEnv(nobody, adapter=ADAPTER, timeout_s=5).reset({}, 0))
    assert unreachable.cause == "env_error" and "cannot reach OpenEnv server ws://127.0.0.1:" in unreachable.detail

    refused = failure(lambda: OpenEnvEnv(server.url + "/elsewhere", adapter=ADAPTER, timeout_s=5).reset({}, 0))
    assert (
        refused.cause == "env_error"
        and f"{server.url[7:]}/elsewhere/ws refused the session: HTTP 403" in refused.detail
    )

    async def bad_action():  # the echo adapter's {"message": ...} is not this server's action
        env = OpenEnvEnv(server.url, timeout_s=5)
        await env.reset({}, 0)
        await env.step("5")

    rejected = failure(bad_action)
    assert rejected.cause == "env_error" and "failed step: VALIDATION_ERROR" in rejected.detail
    assert "guess: Field required" in rejected.detail and "\n" not in rejected.detail

    async def slow_step():
        env = OpenEnvEnv(server.url, adapter=ADAPTER, timeout_s=0.3)
        await env.reset({"delay_s": 2}, 0)
        try:
            with pytest.raises(EpisodeFailure) as slow:
                await env.step("5")
            with pytest.raises(EpisodeFailure) as out_of_step:  # the abandoned step's answer is still on its way
                await env.step("6")
        finally:
            await env.close()
        return slow.value, out_of_step.value

    slow, out_of_step = asyncio.run(slow_step())
    assert slow.cause == "env_timeout" and "did not answer step within 0.3 s" in slow.detail
    assert out_of_step.cause == "env_error" and "out of step" in out_of_step.detail


def test_a_token_goes_in_the_handshake_and_never_in_a_message(openenv_server, monkeypatch):
    server = openenv_server(token="s3cret")
    denied = failure(lambda: OpenEnvEnv(server.url, adapter=ADAPTER, timeout_s=5).reset({}, 0))
    assert (
        denied.cause == "env_error" and 'refused the session: HTTP 401 {"error": "no or wrong token"}' in denied.detail
    )
    wrong = failure(
        lambda: OpenEnvEnv(server.url.replace("//", "//:guess@"), adapter=ADAPTER, timeout_s=5).reset({}, 0)
    )
    assert "HTTP 401" in wrong.detail and "guess@" not in wrong.detail

    async def play(**auth):
        env = OpenEnvEnv(server.url.replace("//", "//:s3cret@") if not auth else server.url, adapter=ADAPTER, **auth)
        try:
            return await env.reset({}, 0)
        finally:
            await env.close()

    monkeypatch.setenv("MY_OPENENV_TOKEN", "s3cret")
    assert asyncio.run(play()) == asyncio.run(play(token="s3cret")) == asyncio.run(play(token_env="MY_OPENENV_TOKEN"))
    assert asyncio.run(play(headers={"Authorization": "Bearer s3cret"})) == "0-9?"


def test_a_full_server_makes_reset_wait_for_a_session_then_fail(openenv_server):
    server = openenv_server(sessions=1)

    async def play():
        holder = OpenEnvEnv(server.url, adapter=ADAPTER, timeout_s=5)
        await holder.reset({}, 0)
        waiter = OpenEnvEnv(server.url, adapter=ADAPTER, timeout_s=5, session_wait_s=10)
        waiting = asyncio.ensure_future(waiter.reset({}, 1))
        await asyncio.sleep(0.5)
        assert not waiting.done()  # retrying while the one session is held
        await holder.close()
        first = await waiting  # the freed session is its
        with pytest.raises(EpisodeFailure) as info:
            await OpenEnvEnv(server.url, adapter=ADAPTER, timeout_s=5, session_wait_s=0.3).reset({}, 2)
        await waiter.close()
        return first, info.value

    first, full = asyncio.run(play())
    assert first == "0-9?"
    assert full.cause == "env_error" and "stayed at capacity (1 of 1 sessions)" in full.detail


def wait_for(probe, what: str, timeout_s: float = 10.0):
    """``probe()``'s first truthy value (the server logs a session's close a moment after the client left)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"{what} did not happen within {timeout_s} s")


# ----------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from asyncrl.config import load_config
    from asyncrl.generators.hf_engine import HfEngine

    cfg = load_config(None, {"model.path": str(tiny_model_dir), "model.recipe": None})
    return HfEngine(cfg.model, seed=0)


@pytest.fixture
def generator(tmp_path, tiny_model_dir, engine, redis_server):
    """A generator (transformers engine, a buffer on the test's redis) playing ``OpenEnvEnv`` episodes
    on ``server`` of records ``{"prompt": "guess:", **task}``."""
    from generator_common import make_generator

    from asyncrl import buffers
    from asyncrl.config import load_config
    from asyncrl.control import RunControl, connect
    from asyncrl.keys import run_prefix
    from asyncrl.weights import MemoryWeightBus

    made = []

    def make(server: Server, task: dict | None = None, **overrides):
        train = tmp_path / "train.jsonl"
        train.write_text(
            "".join(json.dumps({"prompt": "guess:", "answer": "x", **(task or {})}) + "\n" for _ in range(4))
        )
        settings = {
            "model.path": str(tiny_model_dir),
            "model.recipe": None,
            "generator.engine.type": "hf",
            "generator.n_samples": N,
            "generator.max_new_tokens": 4,
            "data.train": str(train),
            "data.eval": None,
            "data.reward": "asyncrl.demo.sort:reward",  # unused: the server's rewards are the episode's
            "learner.groups_per_step": 2,
            "run.max_policy_lag": 8,
            "run.learners": 1,
            "episode.function": "asyncrl.episodes.openenv:OpenEnvEnv",
            "episode.options": {"url": server.url, "adapter": ADAPTER, "timeout_s": 20},
            "episode.max_turns": 3,
            "episode.step_timeout_s": 30,
            **overrides,
        }
        cfg = load_config(None, settings)
        prefix = run_prefix(f"openenv-{uuid.uuid4().hex[:8]}")
        buffer = buffers.setup(cfg.buffer, redis_server.url, prefix)
        made.append(buffer)
        sub = MemoryWeightBus().subscriber("generator-0", have=0)
        return make_generator(cfg, engine, RunControl(connect(redis_server.url), prefix), sub, tiny_model_dir, buffer)

    yield make
    for buffer in made:
        buffer.close()


def accounted(gen) -> dict:
    from asyncrl.buffers.base import lost_groups, unfinished_groups

    counts = gen.buffer.stats()
    assert lost_groups(counts) == 0 and unfinished_groups(counts) == 0, counts
    return counts


@pytest.mark.slow
@pytest.mark.redis
def test_an_openenv_server_plays_a_generators_episodes_end_to_end(openenv_server, generator):
    """Every sample: the server's first observation and replies as mask-0 tokens between the model's
    turns, and the rewards the server paid that session (matched against the server's own log; the
    untrained model's random bytes hold a digit now and then, which the server pays 0.25)."""
    from generator_common import play_groups

    from asyncrl.protocol import decode_group

    server = openenv_server()
    gen = generator(server)
    play_groups(gen, [gen.buffer.try_start_group(0, 8, 2) for _ in range(2)])
    assert dict(gen.stats.failures) == {} and accounted(gen)["pushed"] == 2
    samples = [s for e in gen.buffer.read("rank0", 10, 0) for s in decode_group(e.frame).samples]
    assert len(samples) == 2 * N and all(s.status == "ok" and 1 <= s.turns <= 3 for s in samples)
    tok = gen.chat.tok
    for s in samples:
        observed = tok.decode([t for t, m in zip(s.tokens, s.mask, strict=True) if m == 0])
        assert observed.startswith("0-9?"), observed  # the reset's observation comes before the first turn
        assert observed[4:].replace("hi;", "").replace("lo;", "").replace("?;", "") == "", observed
        assert s.mask[0] == 0 and s.mask.sum() > 0 and s.turn_rewards is not None
        assert float(s.turn_rewards.sum()) == s.reward
        # the server's pay: 0.25 for each wrong digit it answered (hi;/lo;), 1.0 for a right last guess
        paid_for_wrong = 0.25 * (observed.count("hi;") + observed.count("lo;"))
        assert s.reward - paid_for_wrong in (0.0, 0.25, 1.0), (observed, s.reward)  # the last turn's is unseen
    closed = wait_for(lambda: len(server.records("close")) == 2 * N and server.records("close"), "every close")
    assert sorted(s.reward for s in samples) == sorted(r["reward"] for r in closed)
    assert sorted(s.turns for s in samples) == sorted(r["steps"] for r in closed)


async def stepping(server: Server) -> None:
    """Returns once the server has begun a step (its sessions are then mid-episode)."""
    while not server.records("step"):
        await asyncio.sleep(0.02)


@pytest.mark.slow
@pytest.mark.redis
def test_a_server_killed_mid_run_fails_its_episodes_as_env_error(openenv_server, generator):
    """Killed (SIGKILL) while its sessions are mid-step: every episode fails as env_error at once (the
    step timeout is 30 s; nothing waits for it), the groups end failed, and the generator goes on: once
    a server is back at the URL, the next group plays on fresh sessions."""
    server = openenv_server()
    gen = generator(server, task={"delay_s": 0.5})  # every step takes 0.5 s: the kill lands mid-step

    async def play():
        pump = asyncio.create_task(gen.pump.run())
        groups = [asyncio.create_task(gen.run_group(gen.buffer.try_start_group(0, 8, 2))) for _ in range(2)]
        gen.groups.update(groups)
        try:
            await asyncio.wait_for(stepping(server), timeout=60)
            server.kill()
            t0 = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(*groups), timeout=25)
            after_kill_s = time.perf_counter() - t0
            failed = dict(gen.stats.failures), accounted(gen), gen.failures.last_failure.detail
            openenv_server(port=server.port)  # blocks the loop ~1 s: nothing else runs meanwhile
            await asyncio.wait_for(gen.run_group(gen.buffer.try_start_group(0, 8, 2)), timeout=60)
        finally:
            gen.groups.difference_update(groups)
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
        return after_kill_s, failed

    after_kill_s, (failures, counts, detail) = asyncio.run(play())
    assert failures == {"env_error": 2 * N} and counts["failed"] == 2 and counts["pushed"] == 0
    assert after_kill_s < 10, after_kill_s
    assert detail.startswith(f"OpenEnv server {server.url.replace('http://', 'ws://')}/ws "), detail
    assert "closed the session during" in detail or "cannot reach" in detail, detail
    assert dict(gen.stats.failures) == {"env_error": 2 * N} and accounted(gen)["pushed"] == 1
