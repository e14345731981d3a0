"""``asyncrl agent-serve``: an agent written against the OpenAI API as a service that plays a run's episodes
(``episode.agent_url``; the client is :mod:`asyncrl.gateway.agent_remote`), so agents run in their own
container or on another machine, one process serving many episodes.

    asyncrl agent-serve --agent asyncrl.demo.guess_agent:play --host 10.0.0.5 --token-file agent.token

``--agent`` names an ``async def agent(client, task)``, the same function ``episode.agent`` runs in the
generator: here ``client`` is an ``openai.AsyncOpenAI`` over HTTP to the episode's session of the generator
that sent it (its ``base_url`` and key, from the request), ``task`` the record.

Protocol ``asyncrl.agent`` version 1 (JSON over HTTP/1.1, UTF-8; every request carries ``Authorization: Bearer
<token>``; a POST body has ``"schema": "asyncrl.agent", "version": 1`` and ``"id"``, 1-128 characters, one per
episode, the same on each of its retries)::

    POST /episodes   {..., "task": {...}, "base_url": "http(s)://.../v1", "api_key": str}
      200 {"schema", "version", "id", "reward": number | null}    # null: the run scores the last model turn
        | {"schema", "version", "id", "parts": {name: number}}    # named parts, as a reward function's
        | {"schema", "version", "id", "error": one line, "cause": str}
    GET  /health
      200 {"schema", "version", "agent", "running", "played", "rewarded", and a count per cause}

    The answer comes once the agent has finished: the request is held open while it plays. Causes:
    agent_raised (the agent raised over what the model wrote: the run scores it under episode.on_agent_error),
    agent_error (it failed in reaching or being served by the session: an infrastructure failure),
    agent_timeout (it ran past --deadline-s and was cancelled), reward_invalid (it returned no reward).
    400 not JSON, nested over 64 levels, another schema or version, an unknown, missing or mistyped field, a
    base_url that is not http(s)    401 no or wrong token    408 the body did not arrive in time    409 the id
    was seen with another request    413 body over 32 MiB    429 overloaded: retry later    503 shutting down

* **Agents run on the service's event loop**, as ``episode.agent`` runs them on a generator's: many episodes at
  once in one process, at the cost of an HTTP request per model turn. An agent that blocks its loop blocks the
  service (run blocking work in a thread). Each is cancelled at ``--deadline-s``; keep that above the clients'
  ``episode.episode_timeout_s``, whose end closes the session (the agent's next request then fails).
* **Idempotent by id**, from the service kit (:mod:`asyncrl.service.http`): the answers of the last
  :data:`~asyncrl.service.http.CACHE_SIZE` ids are kept, and a retry while the episode plays awaits that same
  play, which is not tied to its HTTP request. The run never sends an episode again once its session saw a
  request, so a restarted service cannot play one twice into the same sample.
* **The session is the run's**: the service reaches whatever ``base_url`` a holder of its token names, and the
  session's key is good for that one episode only.
* **As** ``asyncrl env-serve`` and ``asyncrl reward-serve``: loopback and a token by default (``--token-file``,
  made 0600 when missing, else ``$ASYNCRL_AGENT_TOKEN``, else a temporary 0600 file removed at exit; only the
  file's path is printed), the read deadline, the nesting limit, exit code 2 for an agent that cannot be
  imported or is not ``async``, and SIGINT / SIGTERM exiting 130 / 143 after the episodes playing were
  cancelled (answered 503).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import logging
from collections.abc import Mapping

from asyncrl.data import import_by_path
from asyncrl.errors import EpisodeFailure, UserError
from asyncrl.gateway.agent import infrastructure
from asyncrl.gateway.agent_remote import SCHEMA, TOKEN_ENV, VERSION
from asyncrl.gateway.server import CLIENT_TIMEOUT_S
from asyncrl.rewards.resolve import one_line, reward_parts
from asyncrl.service import http

log = logging.getLogger("asyncrl.gateway.agent_serve")

FIELDS = {"task": dict, "base_url": str, "api_key": str}  # a version-1 request, besides schema, version and id


def check(msg: object) -> str | None:
    """Why ``msg`` is not a version-1 episode request, or None."""
    problem = http.check_request(msg, SCHEMA, VERSION, FIELDS, "episode request")
    if problem is None and not msg["base_url"].startswith(("http://", "https://")):
        return "'base_url' must be an http(s):// URL"
    return problem


class AgentService:
    """``POST /episodes`` and ``GET /health``: the protocol, behind the token, each episode played once."""

    def __init__(self, fn, agent: str, token: str, deadline_s: float):
        self.fn, self.agent, self.deadline_s = fn, agent, deadline_s
        self.door = http.Door(token)
        self.answers = http.Answers(SCHEMA, VERSION, waiting="playing")
        self.counts: collections.Counter[str] = collections.Counter()
        self._http = None  # the HTTP client every agent's OpenAI client shares (one connection pool): client()

    def app(self):
        app = http.new_app()
        app.router.add_post("/episodes", self.episode)
        app.router.add_get("/health", self.health)
        return app

    async def episode(self, request):
        try:
            msg = await self.door.message(request, check)
            asked = [msg[field] for field in FIELDS]
            return await self.answers.answer(msg["id"], http.digest_of(asked), lambda: self.play(*asked))
        except http.Refused as refused:
            return refused.response()

    async def health(self, request):
        if not self.door.authorized(request):
            return http.Refused(401, "missing or wrong bearer token").response()
        running = len(self.answers.computing)
        return http.reply({"schema": SCHEMA, "version": VERSION, "agent": self.agent, "running": running,
                           "played": 0, "rewarded": 0, **self.counts})  # fmt: skip

    async def play(self, task: dict, base_url: str, api_key: str) -> dict:
        """One episode: the agent against the session, its answer (a fault is an answer, never an exception)."""
        import openai

        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=self.client())
        limit = asyncio.timeout(self.deadline_s)
        try:
            async with limit:
                value = await self.fn(client, task)
            answer = {"reward": None} if value is None else _reward(value)
        except Exception as exc:  # noqa: BLE001 - the agent's error is the episode's answer
            if limit.expired():
                answer = {"error": f"no result within the {self.deadline_s:g} s deadline", "cause": "agent_timeout"}
            else:
                answer = {"error": one_line(exc), "cause": "agent_error" if infrastructure(exc) else "agent_raised"}
        self.counts["played"] += 1
        self.counts[answer.get("cause", "rewarded")] += 1
        return answer

    def client(self):
        """The HTTP client under every agent's ``openai.AsyncOpenAI``, made at the first episode (on the loop)."""
        if self._http is None:
            import openai

            # The SDK's aiohttp client where it has one (openai >= 1.97): httpx's own connection pool costs
            # each request a scan of every connection, most of the service's CPU at a hundred agents.
            aiohttp_client = getattr(openai, "DefaultAioHttpClient", None)
            if aiohttp_client is not None:
                self._http = aiohttp_client(timeout=CLIENT_TIMEOUT_S, trust_env=False)
            else:
                import httpx

                self._http = httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, trust_env=False)
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()


def _reward(value: object) -> dict:
    """What an agent returned, as an answer: ``{"reward"}``, ``{"parts"}`` or a ``reward_invalid`` fault."""
    try:
        parts = reward_parts(value)
    except EpisodeFailure as failure:
        return {"error": failure.detail or failure.cause, "cause": "reward_invalid"}
    return {"parts": parts} if isinstance(value, Mapping) else {"reward": parts["reward"]}


def load_agent(agent: str):
    """The ``async def agent(client, task)`` that ``agent`` names; :class:`UserError` otherwise."""
    fn = import_by_path(agent)
    if not inspect.iscoroutinefunction(fn):
        raise UserError(f"--agent {agent!r} must be an `async def agent(client, task)`")
    return fn


def serve(agent: str, *, host: str = "127.0.0.1", port: int = 0, deadline_s: float = 3600.0, token_file=None) -> int:
    """Serve ``agent`` until SIGINT (returns 130) or SIGTERM (143); prints its URL (never its token) once ready."""
    if deadline_s <= 0 or not 0 <= port <= 65535:
        raise UserError("agent-serve needs --deadline-s > 0 and a --port in 0..65535")
    fn = load_agent(agent)
    import openai  # noqa: F401 - imported once here, not by the first episode

    for noisy in ("httpx", "httpx2"):  # the agents' HTTP clients log every model turn at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)

    main = functools.partial(_serve, fn, agent, host, port, deadline_s)  # main(token, token_path)
    return http.serve_until_signal(main, token_file, TOKEN_ENV, "asyncrl-agent-", log)


async def _serve(fn, agent, host, port, deadline_s, token, token_path) -> None:
    """Serve until cancelled (by :func:`~asyncrl.service.http.until_signal`)."""
    service = AgentService(fn, agent, token, deadline_s)
    try:
        async with http.listening(service.app(), host, port, log) as url:
            shape = f"deadline {deadline_s:g} s an episode"
            http.announce("agent-serve", agent, url, shape, token_path, TOKEN_ENV, "episode.agent_url")
            try:
                await asyncio.Future()  # forever: until a signal cancels this
            finally:
                await service.answers.stop()  # the episodes playing are cancelled: their requests answer 503
    finally:
        await service.aclose()
