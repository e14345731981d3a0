"""Agent episodes: an agent written against the OpenAI API, unmodified, as the episode.

``episode.agent: module:function`` names ``async def agent(client, task)``: ``client`` is an
``openai.AsyncOpenAI`` whose base URL and key are the episode's own session on the generator's endpoint
(``asyncrl.gateway.server``), ``task`` the record. It returns the reward (a number, or named
parts), or None. ``episode.agent_command`` instead starts a program per episode, with
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` set for its session, ``ASYNCRL_REWARD_URL`` (where it may
``POST {"reward": x}`` with that key as bearer token) and ``ASYNCRL_SEED``, and the task as JSON on its
standard input; it runs in its own process group, killed when the episode ends early (its timeout, the
generator's shutdown). ``episode.agent_url`` hands each episode to an agent service (``asyncrl agent-serve``,
:mod:`asyncrl.gateway.agent_serve`; the client: :mod:`asyncrl.gateway.agent_remote`) that runs such a
function against the session over HTTP, on its own host. None imports anything from asyncrl.

The reward, first that exists: what the agent function returned; what the session's ``/reward`` was
given; the run's ``data.reward`` on the last model turn's text (the final transcript's answer). A turn that
overran the episode's budget fails it as ``budget`` (the agent saw a 400 ``context_length_exceeded``).

What an agent's failure means (:func:`infrastructure`): an error in reaching or being served by the endpoint
(the ``openai`` client's connection errors, timeouts and error statuses, an OS or HTTP error) fails the episode
as ``agent_error``, kept out of its group as every failed episode is. Any other exception the agent raised is
about what the model wrote (an agent framework's ``ModelBehaviorError``, arguments that are not JSON, too many
turns): under ``episode.on_agent_error: score`` (the default) the episode is a failed attempt, rewarded
``episode.agent_error_reward`` (0.0) and counted (``tools/agent_raised``), so its group trains on the model's
worst outputs instead of dropping them; ``fail`` makes it ``agent_error`` too. An ``agent_command`` program says
the same with its exit status: 0 done, :data:`GAVE_UP_EXIT` (10) the model's output made it give up, any other
a failure of its own; an agent service answers ``agent_raised`` for the former.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import os
import shlex
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from asyncrl.data import import_by_path
from asyncrl.episodes.tools import load_parser
from asyncrl.errors import EpisodeFailure, UserError
from asyncrl.gateway.server import AgentSession, Endpoint, endpoint_for
from asyncrl.rewards.resolve import one_line

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from asyncrl.config import AgentCommandEpisodeConfig, AgentEpisodeConfig, AgentServiceEpisodeConfig
    from asyncrl.episodes.api import Context, Episode

    AgentConfig = AgentEpisodeConfig | AgentCommandEpisodeConfig | AgentServiceEpisodeConfig

STDERR_TAIL = 400  # characters of a failed agent program's standard error kept in its failure's detail
GAVE_UP_EXIT = 10  # an agent program's exit status for "the model's output made me give up"
RAISED = "agent_raised"  # the counter of episodes scored as failed attempts (the generator's tools/... metrics)


def agent_episode(cfg: AgentConfig, endpoint: Endpoint | None = None) -> Episode:
    """The episode that runs ``cfg.agent``, ``cfg.agent_command`` or the service at ``cfg.agent_url`` against a
    session of ``endpoint`` (None: this event loop's, started at the first episode)."""
    play, host = player(cfg)
    parser = load_parser(cfg.tool_parser)

    async def episode(ctx: Context):
        server = endpoint or await endpoint_for(cfg.agent_host, cfg.agent_port)
        session = server.open(ctx, parser, cfg.tool_parser, host)
        try:
            result = await play(server, session, ctx)
        except EpisodeFailure as failure:
            if session.failure is None or session.failure is failure:
                raise
            raise session.failure from failure  # a refused turn (the budget) caused what followed
        except Exception as exc:  # noqa: BLE001 - the agent's error is the episode's data
            return agent_failed(exc, session, cfg, ctx)
        finally:
            server.close(session)
        if session.failure is not None:  # the agent went on after a failed turn: the episode still failed
            raise session.failure
        for reward in (result, session.reward):
            if reward is not None:
                return reward
        text = session.conversation.last_text
        if text is None:
            raise EpisodeFailure("agent_error", "the agent ended without asking the model for a turn")
        return await ctx.score(text)

    return episode


def player(cfg: AgentConfig) -> tuple[Callable[[Endpoint, AgentSession, Context], Awaitable[Any]], str | None]:
    """``(play, host)``: what plays an episode of ``cfg``'s kind against a session, and the address the sessions'
    URLs name (None: the endpoint's own)."""
    if cfg.type == "agent_service":
        from asyncrl.gateway.agent_remote import AgentService

        service = AgentService(cfg.agent_url, cfg.agent_host)
        return (lambda server, session, ctx: service.play(session, ctx)), service.host
    if cfg.type == "agent":
        import openai  # noqa: F401 - imported here, not by the first episode on the generator's event loop

        fn = import_by_path(cfg.agent)
        if not inspect.iscoroutinefunction(fn):
            raise UserError(f"episode.agent {cfg.agent!r} must be an `async def agent(client, task)`")
        return functools.partial(call_agent, fn), None
    argv = shlex.split(cfg.agent_command) if isinstance(cfg.agent_command, str) else cfg.agent_command
    slots = asyncio.Semaphore(cfg.agent_processes or 2 * (os.cpu_count() or 1))

    async def command(server: Endpoint, session: AgentSession, ctx: Context) -> None:
        with ctx.waiting():  # for a slot: the run's time, not the episode's
            await slots.acquire()
        try:
            return await run_command(argv, session, ctx)
        finally:
            slots.release()

    return command, None


class GaveUp(Exception):
    """An agent program's exit with :data:`GAVE_UP_EXIT`: as an exception the agent raised over the model's output."""


def infrastructure(exc: BaseException) -> bool:
    """Whether an agent's exception is about reaching or being served by the endpoint, not the model's output."""
    import httpx
    import openai

    return isinstance(exc, (openai.APIError, httpx.HTTPError, OSError, TimeoutError))


def agent_failed(exc: Exception, session: AgentSession, cfg, ctx: Context) -> float:
    """The reward of an episode whose agent raised ``exc``, or the :class:`EpisodeFailure` it is (module doc)."""
    if session.failure is not None:  # a turn the session refused (the budget): the agent's error followed from it
        raise session.failure from exc
    if cfg.on_agent_error == "fail" or infrastructure(exc):
        raise EpisodeFailure("agent_error", one_line(exc)) from exc
    return gave_up(ctx, cfg, one_line(exc))


def gave_up(ctx: Context, cfg: AgentConfig, detail: str) -> float:
    """An episode the agent abandoned over the model's output: a failed attempt, counted; logged the first time
    (a bug in the agent itself scores every episode so: its detail is the place to look)."""
    if not _told:
        _told.append(detail)
        log.warning("an agent raised over the model's output; scored %s (episode.on_agent_error): %s",
                    cfg.agent_error_reward, detail)  # fmt: skip
    ctx.tool_failures[RAISED] += 1
    return cfg.agent_error_reward


_told: list[str] = []  # the first agent error of this process, once logged


async def call_agent(fn, server: Endpoint, session: AgentSession, ctx: Context):
    """``fn(client, task)`` with a client of the session."""
    import openai

    http = server.local_client()
    try:
        client = openai.AsyncOpenAI(base_url=session.url, api_key=session.key, max_retries=0, http_client=http)
        return await fn(client, ctx.task)
    finally:
        await http.aclose()


async def run_command(argv: list[str], session: AgentSession, ctx: Context) -> None:
    """The agent program of one episode, to its end; killed (its whole process group) if cancelled."""
    env = {
        **os.environ,
        "OPENAI_BASE_URL": session.url,
        "OPENAI_API_KEY": session.key,
        "ASYNCRL_REWARD_URL": session.reward_url,
        "ASYNCRL_SEED": str(ctx.seed),
    }
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=pipe, stdout=asyncio.subprocess.DEVNULL, stderr=pipe, env=env, start_new_session=True
    )
    try:
        _, err = await proc.communicate(json.dumps(ctx.task).encode())
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip()[-STDERR_TAIL:]
        detail = f"{argv[0]} exited with {proc.returncode}: {tail}"
        raise GaveUp(detail) if proc.returncode == GAVE_UP_EXIT else EpisodeFailure("agent_error", detail)
    return None
