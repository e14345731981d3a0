"""An OpenAI-compatible endpoint in the generator: one session per agent episode, each bound to its
episode's :class:`~asyncrl.episodes.api.Context`.

One server per generator (per event loop: the episodes' loop, whose ``Context`` methods it awaits),
started by the first agent episode, on loopback unless ``episode.agent_host`` says otherwise. A
session lives at ``http://host:port/sessions/<id>/v1`` with its own key (an HMAC of its id under a
secret of this process: unguessable, and worthless for any other session):

* ``POST /chat/completions``, ``POST /responses`` (``asyncrl.gateway.responses``) and ``POST /completions``:
  one model turn through the episode's ``ctx.generate`` (the same engine pump, admission, weights, budgets
  and timeouts as any episode), its messages matched against the sample (``asyncrl.gateway.transcript``);
* ``GET /models``; ``POST /sessions/<id>/reward`` (``{"reward": x}`` or ``{"parts": {...}}``): the
  episode's reward, for an agent program that has one.

An agent function's client (``asyncrl.gateway.agent``) reaches its session in process, through
:class:`LocalTransport` (the same :meth:`Endpoint.handle`, without socket, HTTP parsing and connection
pool: the agents run on the generator's loop, so their HTTP would be its CPU); agent programs and
anything else come over the socket.

Errors are OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``: 401 for a missing
or wrong key (another session's included), 404 for a finished session or an unknown route, 400 for a malformed
body or an unsupported parameter, 413 for a body over the limit. A request never touches another
session: each is served under its own session's lock, one turn at a time.

Sampling is the run's: ``temperature`` and ``top_p`` are accepted and not applied (training samples at
``generator.temperature`` / ``top_p``, evaluations greedily, so the behaviour log-probs are those the
learner corrects for). ``max_tokens`` / ``max_completion_tokens`` bound the turn (default
``generator.max_new_tokens``), ``stop`` cuts the returned text (the sample keeps the tokens as
sampled), ``logprobs`` returns each token's behaviour log-prob, ``n`` must be 1; ``stream`` sends the
whole turn as one chunk once sampled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import re
import secrets
import weakref
from typing import TYPE_CHECKING, Any

from asyncrl.errors import EpisodeFailure
from asyncrl.gateway import responses
from asyncrl.gateway.transcript import Answer, BadRequest, Conversation, request_tools
from asyncrl.gateway.wire import CHAT, COMPLETION, MODEL, answer_body, check_params, events, stops, token_logprobs
from asyncrl.service.http import MAX_BODY, MAX_DEPTH, json_depth, read_deadline_s

if TYPE_CHECKING:
    from asyncrl.episodes.api import Context

log = logging.getLogger("asyncrl.agent")

KEY_PREFIX = "sk-asyncrl-"
CLIENT_TIMEOUT_S = 24 * 3600.0  # the agents' clients never give up first: the episode's own timeout governs
# the routes: /sessions/<id>/v1/models (GET), /chat/completions, /completions, /responses; /sessions/<id>/reward
ROUTE = re.compile(
    r"/sessions/([A-Za-z0-9_-]{1,64})/(v1/models|v1/chat/completions|v1/completions|v1/responses|reward)"
)
METHODS = {"v1/models": "GET", "reward": "POST"} | dict.fromkeys(
    ("v1/chat/completions", "v1/completions", "v1/responses"), "POST"
)


class ApiError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, kind: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param

    def reply(self) -> Reply:
        body = {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}
        return Reply(self.status, json.dumps(body).encode())


@dataclasses.dataclass(frozen=True)
class Reply:
    """An answer, whichever way the request came (over HTTP, or in process: :class:`LocalTransport`)."""

    status: int
    content: bytes
    content_type: str = "application/json"


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the body is over {limit} bytes", "invalid_request_error", "body_too_large")


def bad(message: str, code: str = "invalid_request", param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


@dataclasses.dataclass(eq=False)
class AgentSession:
    """One agent episode's view of the endpoint."""

    sid: str
    key: str
    url: str  # the OpenAI base URL: .../sessions/<sid>/v1
    conversation: Conversation
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    reward: Any = None  # what POST .../reward set
    failure: EpisodeFailure | None = None  # the first failure of a turn: the episode's, once the agent ends
    running: set[asyncio.Task] = dataclasses.field(default_factory=set)
    responses: dict[str, list[dict]] = dataclasses.field(default_factory=dict)  # /responses' id -> its conversation
    requests: int = 0  # requests that reached it with its key: none, and its agent has not begun

    @property
    def reward_url(self) -> str:
        return self.url.removesuffix("/v1") + "/reward"

    async def turn(self, work) -> Answer:
        """``work`` (a turn) as a task of this session: closing the session cancels it. Cancelled, it returns
        only once the turn is (its engine request given back to the pump), as ``ctx.generate`` would."""
        task = asyncio.ensure_future(work)
        self.running.add(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.wait({task})
            raise
        finally:
            self.running.discard(task)


class Endpoint:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_body: int = MAX_BODY):
        self.host, self.port, self.max_body = host, port, max_body
        self.sessions: dict[str, AgentSession] = {}
        self._secret = secrets.token_bytes(32)
        self._runner = None

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=self.max_body)
        app.router.add_route("*", "/{tail:.*}", self._http)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def aclose(self) -> None:
        for session in list(self.sessions.values()):
            self.close(session)
        if self._runner is not None:
            await self._runner.cleanup()

    def local_client(self):
        """An HTTP client whose requests reach this endpoint in process (an agent function on the generator's
        event loop): the same handling as over the socket, without the socket, HTTP parsing and connection
        pool (over HTTP, 128 agents cost the loop ~20 ms a request in httpcore's pool alone)."""
        import httpx

        return httpx.AsyncClient(transport=LocalTransport(self), trust_env=False, timeout=CLIENT_TIMEOUT_S)

    # -- sessions -----------------------------------------------------------------------------------------
    def open(self, ctx: Context, parser, parser_name: str, host: str | None = None) -> AgentSession:
        """A new session, its URL naming ``host`` (None: the address the endpoint listens on)."""
        sid = secrets.token_urlsafe(12)
        host = host or self.host
        host = f"[{host}]" if ":" in host else host
        url = f"http://{host}:{self.port}/sessions/{sid}/v1"
        session = AgentSession(sid, self._key(sid), url, Conversation(ctx, parser, parser_name))
        self.sessions[sid] = session
        return session

    def close(self, session: AgentSession) -> None:
        """The session ends: its key stops working, a turn still running is cancelled."""
        self.sessions.pop(session.sid, None)
        for task in session.running:
            task.cancel()

    def _key(self, sid: str) -> str:
        return KEY_PREFIX + hmac.new(self._secret, sid.encode(), hashlib.sha256).hexdigest()

    def _session(self, sid: str, authorization: str) -> AgentSession:
        given = authorization.removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self._key(sid).encode()):
            raise ApiError(401, "missing or wrong API key for this session", "invalid_request_error", "invalid_api_key")
        session = self.sessions.get(sid)
        if session is None:  # the key is right, so this process opened it: its episode has ended
            raise ApiError(404, f"session {sid} has finished", "invalid_request_error", "session_finished")
        return session

    # -- requests -----------------------------------------------------------------------------------------
    async def _http(self, request):
        from aiohttp import web

        try:
            if request.content_length is not None and request.content_length > self.max_body:
                raise too_large(self.max_body)
            try:
                raw = await asyncio.wait_for(request.read(), read_deadline_s(request.content_length))
            except web.HTTPRequestEntityTooLarge:
                raise too_large(self.max_body) from None
            except TimeoutError:
                raise ApiError(408, "the body did not arrive in time", "invalid_request_error", "timeout") from None
            reply = await self.handle(request.method, request.path, request.headers.get("Authorization", ""), raw)
        except ApiError as error:
            reply = error.reply()
        return web.Response(status=reply.status, body=reply.content, content_type=reply.content_type)

    async def handle(self, method: str, path: str, authorization: str, raw: bytes) -> Reply:
        """One request to this endpoint: its answer, or the OpenAI error object."""
        session = None
        try:
            route = ROUTE.fullmatch(path)
            if route is None or METHODS[route.group(2)] != method:
                raise ApiError(404, f"no route {method} {path[:200]}", "invalid_request_error", "unknown_url")
            sid, op = route.groups()
            session = self._session(sid, authorization)
            session.requests += 1
            return await self._op(session, op, raw)
        except ApiError as error:
            return error.reply()
        except BadRequest as error:
            return bad(str(error), error.code, error.param).reply()
        except EpisodeFailure as failure:  # the episode cannot go on (its budget, most often): it fails
            if session is not None:
                session.failure = session.failure or failure
            if failure.cause == "budget":
                return bad(failure.detail, "context_length_exceeded").reply()
            return ApiError(500, str(failure), "server_error", failure.cause).reply()
        except Exception as exc:  # noqa: BLE001 - a bug here fails the request (and its episode), not the server
            log.exception("agent endpoint: a request failed")
            return ApiError(500, f"{type(exc).__name__}: {exc}", "server_error", "internal_error").reply()

    async def _op(self, session: AgentSession, op: str, raw: bytes) -> Reply:
        if op == "v1/models":
            card = {"id": MODEL, "object": "model", "created": 0, "owned_by": "asyncrl"}
            return Reply(200, json.dumps({"object": "list", "data": [card]}).encode())
        if len(raw) > self.max_body:
            raise too_large(self.max_body)
        body = parse(raw)
        if op == "reward":
            if set(body) not in ({"reward"}, {"parts"}):
                raise bad("the body must be {'reward': number} or {'parts': {name: number}}")
            session.reward = body.get("reward", body.get("parts"))
            return Reply(200, b'{"ok": true}')
        if op == "v1/responses":
            return await self._respond(session, body)
        chat = op == "v1/chat/completions"
        check_params(body, CHAT if chat else COMPLETION)
        async with session.lock:
            answer = await session.turn(self._chat(session, body) if chat else self._complete(session, body))
        full = answer_body(answer, body, session.conversation.chat_tokens.tok, chat)
        if body.get("stream"):
            return Reply(200, events(full, chat), "text/event-stream")
        return Reply(200, json.dumps(full).encode())

    async def _chat(self, session: AgentSession, body: dict) -> Answer:
        tools = request_tools(body.get("tools"))
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise bad("tool_choice must be 'auto' or 'none': the model's own turn decides", "unsupported_parameter")
        if choice == "none":
            tools = {}
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        return await session.conversation.chat(body.get("messages"), tools, limit, stops(body))

    async def _respond(self, session: AgentSession, body: dict) -> Reply:
        """``POST /responses`` (``asyncrl.gateway.responses``): its messages, one turn as a chat's, the response."""
        responses.check(body)
        previous = body.get("previous_response_id")
        if previous is not None and previous not in session.responses:
            raise bad(f"previous_response_id {str(previous)[:80]!r} is no response of this session",
                      "previous_response_not_found", "previous_response_id")  # fmt: skip
        messages = responses.messages_of(body, session.responses.get(previous, []))
        tools = request_tools(responses.tools_of(body.get("tools")))
        if body.get("tool_choice", "auto") not in ("auto", "none", None):
            raise bad("tool_choice must be 'auto' or 'none': the model's own turn decides", "unsupported_parameter")
        tools = {} if body.get("tool_choice") == "none" else tools
        limit = body.get("max_output_tokens")
        async with session.lock:
            answer = await session.turn(session.conversation.chat(messages, tools, limit, []))
        tok = session.conversation.chat_tokens.tok
        full = responses.response_body(answer, body, tok, token_logprobs(answer, tok))
        session.responses[full["id"]] = responses.conversation_after(messages, full)
        if body.get("stream"):
            return Reply(200, responses.events(full), "text/event-stream")
        return Reply(200, json.dumps(full).encode())

    async def _complete(self, session: AgentSession, body: dict) -> Answer:
        return await session.conversation.complete(body.get("prompt"), body.get("max_tokens"), stops(body))


def parse(raw: bytes) -> dict:
    """A request's JSON object; 400 ``invalid_json`` for anything else (too deep included)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise bad(f"the body is not JSON: {str(exc)[:200]}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object", "invalid_json")
    if json_depth(body) > MAX_DEPTH:
        raise bad(f"the body is nested more than {MAX_DEPTH} levels deep", "invalid_json")
    return body


class LocalTransport:
    """An httpx transport that hands each request to :meth:`Endpoint.handle` in process."""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint

    async def handle_async_request(self, request):
        import httpx

        raw = await request.aread()
        auth = request.headers.get("Authorization", "")
        reply = await self.endpoint.handle(request.method, request.url.path, auth, raw)
        return httpx.Response(reply.status, content=reply.content, headers={"Content-Type": reply.content_type})

    async def aclose(self) -> None:
        pass


# -- one endpoint per event loop ------------------------------------------------------------------------
_ENDPOINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def endpoint_for(host: str, port: int) -> Endpoint:
    """This event loop's endpoint, started by the first caller (its address logged once)."""
    loop = asyncio.get_running_loop()
    starting = _ENDPOINTS.get(loop)
    if starting is None:
        endpoint = Endpoint(host, port)

        async def start() -> Endpoint:
            await endpoint.start()
            log.info(
                "OpenAI-compatible endpoint for agent episodes at http://%s:%d/sessions/<id>/v1", host, endpoint.port
            )
            return endpoint

        starting = _ENDPOINTS[loop] = asyncio.ensure_future(start())
    return await asyncio.shield(starting)


async def close_endpoint() -> None:
    """Stop this event loop's endpoint, if one started (the generator's shutdown)."""
    starting = _ENDPOINTS.pop(asyncio.get_running_loop(), None)
    if starting is not None and starting.done() and not starting.cancelled() and starting.exception() is None:
        await starting.result().aclose()
