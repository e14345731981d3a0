"""Agents as a service: ``asyncrl agent-serve`` (:mod:`asyncrl.gateway.agent_serve`) and the episode that hands
its task there (``episode.agent_url``, :mod:`asyncrl.gateway.agent_remote`).

Each test plays real episodes: the generator's endpoint on loopback, a scripted engine behind it, and the
service, in process (its aiohttp app on a socket of the same loop) or as the real command, reached over HTTP
as from another host. The real run across a network namespace is ``tests/e2e/test_agent_serve_launch.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys

import httpx
import pytest
from episode_configs import episode_config
from test_openai_endpoint import GUESS, TOK, make_ctx, record, scripted, with_endpoint

from asyncrl.chat import ChatTokens
from asyncrl.demo import guess
from asyncrl.episodes.api import run_episode
from asyncrl.errors import UserError
from asyncrl.gateway import agent_remote
from asyncrl.gateway.agent import agent_episode
from asyncrl.gateway.agent_serve import AgentService, load_agent
from asyncrl.service.http import MAX_BODY, listening

TOKEN = "t0ken"
log = logging.getLogger("test")


class Served:
    """An :class:`AgentService` of ``agent`` listening on loopback, on the running loop."""

    def __init__(self, agent: str, deadline_s: float = 30.0, port: int = 0):
        self.service = AgentService(load_agent(agent), agent, TOKEN, deadline_s)
        self.port = port

    async def __aenter__(self) -> Served:
        self._listening = listening(self.service.app(), "127.0.0.1", self.port, log)
        self.url = await self._listening.__aenter__()
        self.port = int(self.url.rsplit(":", 1)[1])
        return self

    async def __aexit__(self, *exc) -> None:
        await self.service.answers.stop()
        await self._listening.__aexit__(*exc)
        await self.service.aclose()

    @property
    def agent_url(self) -> str:
        return f"http://:{TOKEN}@127.0.0.1:{self.port}"


def play_served(agent: str, ctx, texts_ok=True, **cfg):
    """One episode of ``ctx`` handed to an in-process service of ``agent``: (outcome, the service's counts)."""

    async def work(endpoint):
        async with Served(agent) as served:
            episode = agent_episode(episode_config(agent_url=served.agent_url, **cfg), endpoint)
            out = await run_episode(episode, ctx, 60)
            return out, dict(served.service.counts)

    return with_endpoint(work)


# ----- the episode played there ----------------------------------------------------------------------------


def test_a_served_agent_makes_the_in_process_agents_tokens():
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 11}
    here = make_ctx(chat, task, scripted(chat, "8", "12", "x", "11"))
    out_here = with_endpoint(lambda ep: run_episode(agent_episode(episode_config(agent=GUESS), ep), here, 60))
    there = make_ctx(chat, task, scripted(chat, "8", "12", "x", "11"))
    out, counts = play_served(GUESS, there)
    assert out.status == out_here.status == "ok" and out.reward == out_here.reward == 1.0
    assert record(there) == record(here)  # every token, mask, version and log-prob
    assert counts == {"played": 1, "rewarded": 1}


async def parts_agent(client, task):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    return {"solved": 1.0, "format": 0.5}


async def silent_agent(client, task):
    """Returns nothing: the run scores the last model turn with data.reward."""
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])


async def posting_agent(client, task):
    """Returns nothing but POSTs its reward to the session, as an agent program may."""
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/reward"
    async with httpx.AsyncClient() as http:
        await http.post(url, json={"reward": 0.75}, headers={"Authorization": f"Bearer {client.api_key}"})


async def fussy_agent(client, task):
    r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    raise ValueError(f"cannot act on {r.choices[0].message.content!r}")


async def string_agent(client, task):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    return "a lot"


async def slow_agent(client, task):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    await asyncio.sleep(3600)


async def lost_agent(client, task):
    """Its session's key is wrong: the endpoint refuses it (an infrastructure failure)."""
    import openai

    other = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="sk-wrong", max_retries=0)
    await other.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])


@pytest.mark.parametrize(
    ("agent", "fields", "status", "reward", "cause"),
    [
        ("parts_agent", {}, "ok", {"solved": 1.0, "format": 0.5}, "rewarded"),
        ("silent_agent", {}, "ok", 1.0, "rewarded"),  # data.reward on "9": right
        ("posting_agent", {}, "ok", 0.75, "rewarded"),
        ("fussy_agent", {}, "ok", 0.0, "agent_raised"),  # a failed attempt, trained on
        ("fussy_agent", {"agent_error_reward": -1.0}, "ok", -1.0, "agent_raised"),
        ("fussy_agent", {"on_agent_error": "fail"}, "agent_error", None, "agent_raised"),
        ("lost_agent", {}, "agent_error", None, "agent_error"),  # infrastructure: kept out of its group
        ("string_agent", {}, "reward_invalid", None, "reward_invalid"),
    ],
)
def test_what_the_service_answers_is_what_an_in_process_agent_would_have_made(agent, fields, status, reward, cause):
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 9}
    ctx = make_ctx(chat, task, scripted(chat, "9"))
    out, counts = play_served(f"{__name__}:{agent}", ctx, **fields)
    assert out.status == status, out.detail
    assert counts == {"played": 1, cause: 1}
    if isinstance(reward, dict):
        assert out.parts == reward
    elif reward is not None:
        assert out.reward == reward
    assert ctx.tool_failures["agent_raised"] == (cause == "agent_raised" and status == "ok")


def test_an_agent_past_the_services_deadline_is_cancelled_and_its_episode_fails_as_infrastructure():
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 9}
    ctx = make_ctx(chat, task, scripted(chat, "9"))

    async def work(endpoint):
        served = Served(f"{__name__}:slow_agent", deadline_s=0.5)
        async with served:
            episode = agent_episode(episode_config(agent_url=served.agent_url), endpoint)
            out = await run_episode(episode, ctx, 60)
            return out, dict(served.service.counts)

    out, counts = with_endpoint(work)
    assert out.status == "agent_error" and "0.5 s deadline" in out.detail
    assert counts == {"played": 1, "agent_timeout": 1}


# ----- a service that is down, or goes down ----------------------------------------------------------------


def test_a_service_that_is_down_holds_the_episode_until_it_is_back():
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 11}
    ctx = make_ctx(chat, task, scripted(chat, "8", "12", "11"))

    async def work(endpoint):
        probe = Served(GUESS)
        async with probe:
            port = probe.port  # a free port; nothing listens there once the probe closed
        episode = agent_episode(episode_config(agent_url=f"http://:{TOKEN}@127.0.0.1:{port}"), endpoint)
        playing = asyncio.ensure_future(run_episode(episode, ctx, 60))
        await asyncio.sleep(1.0)  # refused, retried
        assert not playing.done() and ctx.turns == 0
        async with Served(GUESS, port=port) as served:
            out = await playing
            return out, dict(served.service.counts)

    out, counts = with_endpoint(work)
    assert out.status == "ok" and out.reward == 1.0 and ctx.turns == 3
    assert counts == {"played": 1, "rewarded": 1}  # played once, when the service was back


async def first_turn_then_wait(client, task):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    await asyncio.sleep(3600)


def test_an_episode_the_service_dropped_after_it_began_fails_and_is_never_played_again():
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 11}
    ctx = make_ctx(chat, task, scripted(chat, "8", "12", "11"))

    async def work(endpoint):
        served = Served(f"{__name__}:first_turn_then_wait")
        async with served:
            cfg = episode_config(agent_url=served.agent_url)
            playing = asyncio.ensure_future(run_episode(agent_episode(cfg, endpoint), ctx, 60))
            while ctx.turns == 0:
                await asyncio.sleep(0.02)
        # the service is gone (its connections closed) after the episode's first turn
        async with Served(GUESS, port=served.port) as again:
            out = await playing
            return out, dict(again.service.counts)

    out, counts = with_endpoint(work)
    assert out.status == "agent_error" and "had begun there" in out.detail
    assert counts == {} and ctx.turns == 1  # the service that came back never saw it


# ----- bad input ---------------------------------------------------------------------------------------------


def request(**fields) -> dict:
    body = {"schema": "asyncrl.agent", "version": 1, "id": "e1", "task": {"prompt": "p"},
            "base_url": "http://127.0.0.1:9/v1", "api_key": "k"}  # fmt: skip
    body.update(fields)
    return {k: v for k, v in body.items() if v is not None}


def test_bad_requests_get_one_4xx_each_and_play_nothing():
    async def work(endpoint):
        async with Served(f"{__name__}:parts_agent") as served, httpx.AsyncClient(timeout=30) as http:
            auth = {"Authorization": f"Bearer {TOKEN}"}
            url = served.url + "/episodes"

            async def post(body, headers=auth, raw=None):
                r = await http.post(url, content=raw if raw is not None else json.dumps(body), headers=headers)
                return r.status_code, r.text

            deep = {"prompt": "p"}
            for _ in range(100):
                deep = {"x": deep}
            answers = {
                "no token": await post(request(), headers={}),
                "wrong token": await post(request(), headers={"Authorization": "Bearer nope"}),
                "not JSON": await post(None, raw=b"{nope"),
                "another version": await post(request(version=2)),
                "unknown field": await post(request(seed=3)),
                "missing field": await post(request(api_key=None)),
                "mistyped field": await post(request(task="p")),
                "not http": await post(request(base_url="file:///etc/passwd")),
                "nested": await post(request(task=deep)),
                "huge": await post(None, raw=b'{"a": "' + b"x" * (MAX_BODY + 10) + b'"}'),
            }
            health = await http.get(served.url + "/health")
            return answers, health.status_code, dict(served.service.counts)

    answers, health, counts = with_endpoint(work)
    statuses = {what: status for what, (status, _) in answers.items()}
    assert statuses == {"no token": 401, "wrong token": 401, "not JSON": 400, "another version": 400,
                        "unknown field": 400, "missing field": 400, "mistyped field": 400, "not http": 400,
                        "nested": 400, "huge": 413}  # fmt: skip
    assert "'seed'" in answers["unknown field"][1] and "64 levels" in answers["nested"][1]
    assert health == 401 and counts == {}  # nothing played


def test_a_reused_id_with_another_request_is_409_and_the_same_request_is_answered_once():
    async def work(endpoint):
        async with Served(f"{__name__}:string_agent") as served, httpx.AsyncClient(timeout=30) as http:
            auth = {"Authorization": f"Bearer {TOKEN}"}
            first = await http.post(served.url + "/episodes", json=request(), headers=auth)
            again = await http.post(served.url + "/episodes", json=request(), headers=auth)
            other = await http.post(served.url + "/episodes", json=request(task={"prompt": "q"}), headers=auth)
            health = (await http.get(served.url + "/health", headers=auth)).json()
            return first.json(), again.json(), other.status_code, health

    first, again, other, health = with_endpoint(work)
    assert first == again and first["cause"] == "agent_error"  # nothing listens on port 9: never reached
    assert other == 409
    assert health["played"] == 1 and health["running"] == 0 and health["agent"].endswith(":string_agent")


# ----- config, start-up, signals -----------------------------------------------------------------------------


def test_a_service_on_another_host_needs_an_endpoint_it_can_reach():
    with pytest.raises(ValueError, match="listens on loopback"):
        episode_config(agent_url="http://:t@10.1.2.3:8000")
    cfg = episode_config(agent_url="http://:t@10.1.2.3:8000", agent_host="10.1.2.1")
    assert cfg.type == "agent_service"
    with pytest.raises(ValueError, match="http"):
        episode_config(agent_url="10.1.2.3:8000")
    with pytest.raises(UserError, match="no token"):
        agent_remote.AgentService("http://127.0.0.1:8000", "127.0.0.1")
    # an endpoint on every address names, for each service, this host's address on the route to it
    assert agent_remote.session_host("0.0.0.0", "127.0.0.1") == "127.0.0.1"
    assert agent_remote.session_host("10.1.2.1", "10.1.2.3") is None


def test_the_command_serves_until_sigterm_and_never_prints_its_token(tmp_path):
    token_file = tmp_path / "agent.token"
    cmd = [sys.executable, "-m", "asyncrl.cli", "agent-serve", "--agent", GUESS, "--token-file", str(token_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert "asyncrl agent-serve: asyncrl.demo.guess_agent:play at http://127.0.0.1:" in line, line
        url = line.split(" at ", 1)[1].split()[0]
        token = token_file.read_text().strip()
        health = httpx.get(url + "/health", headers={"Authorization": f"Bearer {token}"}, timeout=30).json()
        assert health["schema"] == "asyncrl.agent" and health["running"] == 0
        os.kill(proc.pid, signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and token not in line + rest and "Traceback" not in rest
    bad = subprocess.run([*cmd[:-4], "--agent", "asyncrl.demo.guess:reward"], capture_output=True, text=True)
    assert bad.returncode == 2 and "must be an `async def agent(client, task)`" in bad.stderr
