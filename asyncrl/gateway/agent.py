"""Agent episodes: an agent written against the OpenAI API, unmodified, as the episode.

``episode.agent: module:function`` names ``async def agent(client, task)``: ``client`` is an
``openai.AsyncOpenAI`` whose base URL and key are the episode's own session on the generator's endpoint
(``asyncrl.gateway.server``), ``task`` the record. It returns the reward (a number, or named
parts), or None. ``episode.agent_command`` instead starts a program per episode, with
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` set for its session, ``ASYNCRL_REWARD_URL`` (where it may
``POST {"reward": x}`` with that key as bearer token) and ``ASYNCRL_SEED``, and the task as JSON on its
standard input; it runs in its own process group, killed when the episode ends early (its timeout, the
generator's shutdown). Neither imports anything from asyncrl.

The reward, first that exists: what the agent function returned; what the session's ``/reward`` was
given; the run's ``data.reward`` on the last model turn's text (the final transcript's answer). An
agent that raises or exits non-zero fails the episode as ``agent_error``; a turn that overran the
episode's budget fails it as ``budget`` (the agent saw a 400 ``context_length_exceeded``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import shlex
import signal
from typing import TYPE_CHECKING

from asyncrl.data import import_by_path
from asyncrl.episodes.tools import load_parser
from asyncrl.errors import EpisodeFailure, UserError
from asyncrl.gateway.server import AgentSession, Endpoint, endpoint_for
from asyncrl.rewards.resolve import one_line

if TYPE_CHECKING:
    from asyncrl.config import AgentCommandEpisodeConfig, AgentEpisodeConfig
    from asyncrl.episodes.api import Context, Episode

STDERR_TAIL = 400  # characters of a failed agent program's standard error kept in its failure's detail


def agent_episode(cfg: AgentEpisodeConfig | AgentCommandEpisodeConfig, endpoint: Endpoint | None = None) -> Episode:
    """The episode that runs ``cfg.agent`` or ``cfg.agent_command`` against a session of ``endpoint``
    (None: this event loop's, started at the first episode)."""
    fn = argv = None
    if cfg.type == "agent":
        import openai  # noqa: F401 - imported here, not by the first episode on the generator's event loop

        fn = import_by_path(cfg.agent)
        if not inspect.iscoroutinefunction(fn):
            raise UserError(f"episode.agent {cfg.agent!r} must be an `async def agent(client, task)`")
    else:
        argv = shlex.split(cfg.agent_command) if isinstance(cfg.agent_command, str) else cfg.agent_command
    parser = load_parser(cfg.tool_parser)

    async def episode(ctx: Context):
        server = endpoint or await endpoint_for(cfg.agent_host, cfg.agent_port)
        session = server.open(ctx, parser, cfg.tool_parser)
        try:
            if fn is not None:
                result = await call_agent(fn, server, session, ctx)
            else:
                result = await run_command(argv, session, ctx)
        except EpisodeFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - the agent's error is the episode's data
            if session.failure is not None:
                raise session.failure from exc
            raise EpisodeFailure("agent_error", one_line(exc)) from exc
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
        raise EpisodeFailure("agent_error", f"{argv[0]} exited with {proc.returncode}: {tail}")
    return None
