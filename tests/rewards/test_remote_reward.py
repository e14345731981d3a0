"""The remote-reward client: against a real ``asyncrl reward-serve`` and against scripted fake servers.

Fake servers run in the test's own event loop and record every request id they see and how many
requests were in flight at once. "Slow" is a handler that waits on an event nobody sets before the
client's deadline; "down" is a loopback port nothing listens on. Outcomes decide every test, never
durations.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from test_reward_serve import Served, start_reward_serve

from asyncrl.errors import EpisodeFailure, UserError
from asyncrl.fleet.redis_server import free_loopback_port
from asyncrl.rewards.remote import SCHEMA, TOKEN_ENV, VERSION, RemoteReward
from asyncrl.rewards.resolve import load_reward, score

TOKEN = "test-token-123"


def counting_reward(prompt: str, completion: str, record: dict):
    """Appends one line to ``record["calls"]`` per computation: the count of real calls."""
    with open(record["calls"], "a") as f:
        f.write(completion + "\n")
    if record.get("raise"):
        raise RuntimeError("the reward broke")
    if record.get("parts"):
        return {"format": 0.5, "answer": 1.0}
    return float(len(completion))


# ----- a scripted fake server --------------------------------------------------------------------

Handler = Callable[[dict, int], Awaitable[tuple[int, object]]]  # (request, call number) -> (status, body)


class Fake:
    """What a fake server saw: request ids, Authorization headers, the most requests in flight."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.ids: list[str] = []
        self.auth: list[str | None] = []
        self.inflight = self.max_inflight = 0
        self.release = asyncio.Event()  # slow handlers wait on it; set at teardown

    async def handle(self, request: web.Request) -> web.Response:
        msg = await request.json()
        self.ids.append(msg["id"])
        self.auth.append(request.headers.get("Authorization"))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            status, body = await self.handler(msg, len(self.ids))
        finally:
            self.inflight -= 1
        text = body if isinstance(body, str) else json.dumps(body)
        return web.Response(status=status, text=text, content_type="application/json")


@contextlib.asynccontextmanager
async def fake_server(handler: Handler):
    """``(fake, url)`` of a fake reward server on a free loopback port."""
    fake = Fake(handler)
    app = web.Application()
    app.router.add_post("/score", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield fake, f"http://127.0.0.1:{runner.addresses[0][1]}/score"
    finally:
        fake.release.set()
        await runner.cleanup()


def ok(msg: dict, **answer) -> tuple[int, dict]:
    return 200, {"schema": SCHEMA, "version": VERSION, "id": msg["id"], **(answer or {"reward": 1.0})}


def statuses(*codes: int) -> Handler:
    """Answer the i-th call with ``codes[i]`` (an error body), then a reward of 1.0."""

    async def handler(msg: dict, n: int):
        return (codes[n - 1], {"error": f"scripted {codes[n - 1]}"}) if n <= len(codes) else ok(msg)

    return handler


async def call(handler: Handler, **client) -> tuple[Fake, object]:
    """``(fake, the reward or the EpisodeFailure)`` of one call through a fake server."""
    async with fake_server(handler) as (fake, url):
        async with RemoteReward(url, **{"timeout_s": 10, "token": TOKEN, "backoff_s": 0.01, **client}) as rr:
            try:
                return fake, await rr("p", "c", {"k": 1})
            except EpisodeFailure as exc:
                return fake, exc


# ----- retries, timeouts, limits -------------------------------------------------------------------


def test_5xx_and_429_are_retried_with_the_same_id():
    fake, got = asyncio.run(call(statuses(500, 429, 503), retries=3))
    assert got == 1.0
    assert len(fake.ids) == 4 and len(set(fake.ids)) == 1


def test_exhausted_retries_are_reward_error():
    fake, got = asyncio.run(call(statuses(*[500] * 10), retries=2))
    assert isinstance(got, EpisodeFailure) and got.cause == "reward_error"
    assert "3 attempt(s)" in got.detail and "scripted 500" in got.detail
    assert len(fake.ids) == 3 and len(set(fake.ids)) == 1


@pytest.mark.parametrize("code", [400, 401, 404, 408, 409, 413])
def test_4xx_is_not_retried(code: int):
    fake, got = asyncio.run(call(statuses(code), retries=3))
    assert isinstance(got, EpisodeFailure) and got.cause == "reward_error" and f"HTTP {code}" in got.detail
    assert len(fake.ids) == 1


@pytest.mark.parametrize(
    ("cause", "expected"),
    [
        (None, "reward_error"),
        ("reward_timeout", "reward_timeout"),
        ("reward_invalid", "reward_invalid"),
        ("x", "reward_error"),
    ],
)
def test_error_answer_is_an_episode_failure_and_not_retried(cause, expected):
    async def handler(msg, n):
        return ok(msg, error="it broke", **({"cause": cause} if cause else {}))

    fake, got = asyncio.run(call(handler, retries=3))
    assert isinstance(got, EpisodeFailure) and got.cause == expected and "it broke" in got.detail
    assert len(fake.ids) == 1


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        "[1, 2]",
        {"schema": SCHEMA, "version": 2, "id": "?", "reward": 1.0},
        {"schema": SCHEMA, "version": VERSION, "id": "another id", "reward": 1.0},
        {"schema": SCHEMA, "version": VERSION, "id": "?"},
    ],
)
def test_malformed_answers_are_reward_error(body):
    async def handler(msg, n):
        answer = json.loads(json.dumps(body).replace('"?"', json.dumps(msg["id"]))) if isinstance(body, dict) else body
        return 200, answer

    fake, got = asyncio.run(call(handler, retries=3))
    assert isinstance(got, EpisodeFailure) and got.cause == "reward_error"
    assert len(fake.ids) == 1


def test_slow_server_is_reward_timeout():
    fakes: list[Fake] = []

    async def handler(msg, n):
        await fakes[0].release.wait()  # set only at teardown, long after the client's deadline
        return ok(msg)

    async def main():
        async with fake_server(handler) as (fake, url):
            fakes.append(fake)
            async with RemoteReward(url, timeout_s=0.3, token=TOKEN, retries=3) as rr:
                with pytest.raises(EpisodeFailure) as failed:
                    await rr("p", "c", {})
            return fake, failed.value

    fake, failure = asyncio.run(main())
    assert failure.cause == "reward_timeout"
    assert len(fake.ids) == 1  # a timed-out call has no time left to retry


def test_server_down_is_reward_error_after_retries():
    async def main():
        async with RemoteReward(f"http://127.0.0.1:{free_loopback_port()}/score", timeout_s=10, token=TOKEN,
                                retries=2, backoff_s=0.01) as rr:  # fmt: skip
            with pytest.raises(EpisodeFailure) as failed:
                await rr("p", "c", {})
        return failed.value

    failure = asyncio.run(main())
    assert failure.cause == "reward_error" and "3 attempt(s)" in failure.detail
    assert TOKEN not in str(failure)


def test_concurrency_limit_is_honoured():
    limit, calls = 3, 12
    full = asyncio.Event()
    fakes: list[Fake] = []

    async def handler(msg, n):
        if fakes[0].inflight >= limit:
            full.set()
        with contextlib.suppress(TimeoutError):  # only a client that never reaches the limit waits this out
            await asyncio.wait_for(full.wait(), 10)
        return ok(msg)

    async def main():
        async with fake_server(handler) as (fake, url):
            fakes.append(fake)
            async with RemoteReward(url, timeout_s=30, token=TOKEN, concurrency=limit) as rr:
                got = await asyncio.gather(*(rr("p", str(i), {}) for i in range(calls)))
            return fake, got

    fake, got = asyncio.run(main())
    assert got == [1.0] * calls
    assert fake.max_inflight == limit
    assert len(set(fake.ids)) == calls  # one id per logical request


def test_the_loops_session_closes_with_the_loop_without_close():
    async def handler(msg, n):
        return ok(msg)

    async def main() -> RemoteReward:
        async with fake_server(handler) as (fake, url):
            rr = RemoteReward(url, timeout_s=10, token=TOKEN)
            assert await rr("p", "c", {}) == 1.0
            assert len(rr._sessions) == 1
            return rr

    assert len(asyncio.run(main())._sessions) == 0  # closed by asyncio.run's shutdown of async generators


# ----- the token -----------------------------------------------------------------------------------


def test_token_sources_and_precedence(monkeypatch: pytest.MonkeyPatch):
    async def handler(msg, n):
        return ok(msg)

    async def seen_auth(url_token: str | None, **client) -> str | None:
        async with fake_server(handler) as (fake, url):
            if url_token:
                url = url.replace("http://", f"http://:{url_token}@")
            async with RemoteReward(url, timeout_s=10, **client) as rr:
                assert url_token not in repr(rr) if url_token else True
                await rr("p", "c", {})
            return fake.auth[0]

    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert asyncio.run(seen_auth(None)) == "Bearer from-env"
    assert asyncio.run(seen_auth("from-url")) == "Bearer from-url"  # and no Basic header from the URL
    assert asyncio.run(seen_auth("from-url", token="from-arg")) == "Bearer from-arg"
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(UserError, match=TOKEN_ENV):
        RemoteReward("http://127.0.0.1:1/score", timeout_s=1)
    with pytest.raises(UserError, match="not an http"):
        RemoteReward("ftp://127.0.0.1/score", timeout_s=1, token=TOKEN)


# ----- against a real reward-serve -----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    server = start_reward_serve(
        tmp_path_factory.mktemp("serve"), "test_remote_reward:counting_reward", "--workers", "2"
    )
    yield server
    server.stop()


def test_load_reward_and_score_through_reward_serve(served: Served, tmp_path: Path):
    calls = tmp_path / "calls"
    reward = load_reward(served.token_url, timeout_s=60)
    assert isinstance(reward, RemoteReward) and served.token not in repr(reward)

    async def main():
        plain = await score(reward, "p", "four", {"calls": str(calls)}, 60)
        parts = await score(reward, "p", "x", {"calls": str(calls), "parts": True}, 60)
        with pytest.raises(EpisodeFailure) as failed:
            await score(reward, "p", "x", {"calls": str(calls), "raise": True}, 60)
        await reward.close()
        return plain, parts, failed.value

    plain, parts, failure = asyncio.run(main())
    assert plain == {"reward": 4.0}
    assert parts == {"format": 0.5, "answer": 1.0}
    assert failure.cause == "reward_error" and "RuntimeError: the reward broke" in failure.detail
    assert len(calls.read_text().splitlines()) == 3


def test_retry_after_a_lost_answer_is_answered_from_the_cache(served: Served, tmp_path: Path):
    """A proxy forwards each request to the real server but loses the first answer (502): the retry
    carries the same id and gets the server's cached answer, computed once."""
    calls = tmp_path / "calls"

    async def main():
        async with aiohttp.ClientSession() as upstream:

            async def lossy_proxy(msg, n):
                headers = {"Authorization": f"Bearer {served.token}"}
                async with upstream.post(served.url, json=msg, headers=headers) as resp:
                    answer = await resp.json()
                return (502, {"error": "answer lost"}) if n == 1 else (resp.status, answer)

            async with fake_server(lossy_proxy) as (fake, url):
                async with RemoteReward(url, timeout_s=60, token=TOKEN, backoff_s=0.01) as rr:
                    return fake, await rr("p", "seven", {"calls": str(calls)})

    fake, got = asyncio.run(main())
    assert got == 5.0
    assert len(fake.ids) == 2 and len(set(fake.ids)) == 1  # the retry reused the id
    assert calls.read_text().splitlines() == ["seven"]  # and the reward ran once
