"""An agent service (``asyncrl agent-serve``): the client side of protocol ``asyncrl.agent`` version 1.

``episode.agent_url: http://:TOKEN@HOST:PORT`` hands every episode to the service: the run POSTs the task with
the episode's own session of the generator's OpenAI-compatible endpoint (its base URL and key), the service
runs its agent against that session and answers with the reward, or with none (the run then scores the last
model turn with ``data.reward``, as for an agent function). The protocol is documented in
:mod:`asyncrl.gateway.agent_serve` (and ``docs/episodes.md``).

Client policy (the kit's client, :mod:`asyncrl.service.client`): one request per episode, under one id. A
request without an answer (the connection refused or dropped, 408, 429, 5xx) is sent again under the same id,
with jittered back-off (0.1 s doubling to :data:`BACKOFF_CAP_S`), **only while the session has seen no
request**: an agent that has not begun cannot have played any of the episode. Once it has, a service that lost
the episode (killed, restarted) fails it as ``agent_error``, an infrastructure failure kept out of its group,
instead of playing it again into the same sample. So a service that goes down fails the episodes it was
playing, and holds the others until it is back (their ``episode.episode_timeout_s`` still runs). Another 4xx
(a wrong token, another protocol version) fails the episode as ``agent_error`` at once.

The service's answers (:func:`outcome`): a reward, named parts, or none; ``agent_raised`` (the agent raised
over what the model wrote) is what an agent function's own exception is, scored under
``episode.on_agent_error``; ``agent_error`` and ``agent_timeout`` are infrastructure failures
(``agent_error``); ``reward_invalid`` is that failure.

The endpoint must be reachable by the service: it listens where ``episode.agent_host`` says (loopback by
default, so a service on another host needs that setting, which the config checks), and a session's URL names
that address, or, for ``0.0.0.0``, this host's address on the route to the service (:func:`session_host`).
The token comes from the URL's password, else ``$ASYNCRL_AGENT_TOKEN``, and travels only in the Authorization
header.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from asyncrl.errors import EpisodeFailure, UserError
from asyncrl.gateway.server import CLIENT_TIMEOUT_S
from asyncrl.net import backoff_s, local_address_to, redact_url
from asyncrl.service.client import CallFailed, JsonClient, LoopSessions, Unanswered, bearer_token, without_credentials

if TYPE_CHECKING:
    from asyncrl.episodes.api import Context
    from asyncrl.gateway.server import AgentSession

log = logging.getLogger("asyncrl.agent")

SCHEMA = "asyncrl.agent"
VERSION = 1
TOKEN_ENV = "ASYNCRL_AGENT_TOKEN"
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.1, 5.0  # a service restarting takes seconds: waiting episodes retry every few
CONNECTIONS = 1024  # per event loop: one held request per episode in flight, far above a generator's
_SHARED = LoopSessions(CONNECTIONS)
WILDCARDS = ("0.0.0.0", "::", "")


class AgentRaised(Exception):
    """The service's ``agent_raised``: the agent gave up over what the model wrote (a failed attempt)."""


def session_host(listen: str, service_host: str) -> str | None:
    """The address a session's URL names for a service at ``service_host``: None (the one the endpoint listens
    on), unless it listens on every address; then this host's address on the route to the service."""
    if listen not in WILDCARDS:
        return None
    try:
        return local_address_to(socket.gethostbyname(service_host))
    except OSError as exc:
        raise UserError(f"no route to the agent service's host {service_host!r}: {exc}") from None


class AgentService:
    """The agent service ``url`` names (``http://:TOKEN@host:port``), for the sessions of an endpoint that
    listens on ``listen``."""

    def __init__(self, url: str, listen: str):
        parts = urlsplit(url)
        token = bearer_token(url, TOKEN_ENV)
        if not token:
            raise UserError(
                f"episode.agent_url {redact_url(url)} has no token: http://:TOKEN@host:port or ${TOKEN_ENV}"
            )
        base = without_credentials(url).rstrip("/")
        self.where = f"the agent service at {base}"
        self.client = JsonClient(base, token, _SHARED, schema=SCHEMA, version=VERSION, base_s=BACKOFF_BASE_S,
                                 cap_s=BACKOFF_CAP_S, retries=0, retry_on=(408, 429), where=self.where)  # fmt: skip
        self.host = session_host(listen, parts.hostname or "")

    async def play(self, session: AgentSession, ctx: Context) -> Any:
        """The episode played by the service against ``session``: what :func:`outcome` makes of its answer."""
        fields = {"task": ctx.task, "base_url": session.url, "api_key": session.key}
        rid, attempt = uuid.uuid4().hex, 0
        deadline = asyncio.get_running_loop().time() + CLIENT_TIMEOUT_S  # the episode's own timeout governs
        while True:
            try:
                answer = await self.client.request("/episodes", rid, fields, deadline)
                return outcome(answer)
            except Unanswered as exc:
                if session.requests or exc.timed_out:
                    raise EpisodeFailure("agent_error", f"{exc}; the episode had begun there") from None
                if attempt == 0:
                    log.warning("%s; the episode waits for it (retrying)", exc)
            except CallFailed as exc:  # a 4xx a retry would not change, or an answer that is not JSON
                raise EpisodeFailure("agent_error", str(exc)) from None
            await asyncio.sleep(backoff_s(attempt, BACKOFF_BASE_S, BACKOFF_CAP_S))
            attempt += 1


def outcome(answer: dict) -> Any:
    """The episode's result from the service's answer: its reward (a number, named parts, or None: the run
    scores the last model turn); :class:`AgentRaised` for ``agent_raised``; :class:`EpisodeFailure` otherwise."""
    if "error" in answer:
        cause, detail = answer.get("cause"), f"the agent service: {str(answer['error'])[:400]}"
        if cause == "agent_raised":
            raise AgentRaised(detail)
        raise EpisodeFailure("reward_invalid" if cause == "reward_invalid" else "agent_error", detail)
    if isinstance(answer.get("parts"), dict):
        return answer["parts"]
    reward = answer.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
        raise EpisodeFailure("reward_invalid", f"the agent service answered the reward {reward!r:.60}")
    return reward
