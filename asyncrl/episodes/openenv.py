"""Environments served by OpenEnv (``openenv-core``): an OpenEnv server plays asyncrl episodes by URL.

    episode:
      function: asyncrl.episodes.openenv:OpenEnvEnv
      options: {url: "http://envs.example:8000", adapter: "my_envs:CodingAdapter", timeout_s: 20}

:class:`OpenEnvEnv` is an ``async`` Env (see ``asyncrl.episodes.api``): it runs on the generator's
event loop and never blocks it. It speaks OpenEnv's own wire protocol (``openenv.core.env_server``,
version 0.3.0) and needs only the ``websockets`` package here; the server needs ``openenv-core``.

Sessions. OpenEnv's HTTP ``POST /reset`` and ``/step`` are stateless: each request builds a fresh
environment and closes it, so they cannot carry an episode of many turns. Its WebSocket endpoint
``/ws`` is the stateful one: the server builds one environment instance per connection and keeps it
until the connection closes. Each OpenEnvEnv (one per episode) therefore opens its own WebSocket at
``reset`` and closes it at ``close``: one OpenEnv session per episode, so concurrent episodes never
share environment state (the server runs each session's calls in a thread of its own). A server
holds at most its ``max_concurrent_envs`` sessions (1 unless its app says more, which needs an
environment with ``SUPPORTS_CONCURRENT_SESSIONS``); every episode running at once holds one, so that
limit must cover the generator's episodes in flight. A full server answers a new session with
``CAPACITY_REACHED``; ``reset`` tries again with back-off for ``session_wait_s`` (a slot freed by an
episode that just ended is released a moment after its close) and then fails with ``env_error``.

Messages (JSON text frames, one answer per request, in order)::

    -> {"type": "reset", "data": {...adapter.reset_kwargs(task, seed)}}    default {"seed": seed}
    -> {"type": "step",  "data": {...adapter.action(text, task)}}          the Action's fields
    <- {"type": "observation", "data": {"observation": {...}, "reward": float | null, "done": bool}}
    <- {"type": "error", "data": {"message": str, "code": "VALIDATION_ERROR" | "EXECUTION_ERROR" |
                                  "CAPACITY_REACHED" | ...}}
    -> {"type": "close"}                                                   then the socket closes

The **adapter** (``options.adapter``, ``'module:name'`` of an object or of a class built with no
arguments) maps OpenEnv's typed world to text: ``action(text, task) -> dict`` (the Action's JSON
fields), ``observation(obs: dict) -> str`` (what the model reads; ``obs`` is the Observation's fields
without ``reward``, ``done`` and ``metadata``, which the server strips) and, optionally,
``reset_kwargs(task, seed) -> dict``. Its methods are plain and quick (they run on the event loop),
and one adapter serves every episode of the process: it keeps no episode's state (the task is passed).
The default, :class:`EchoAdapter`, fits OpenEnv's echo environment (``{"message": text}``). Reward
and done are the server's: a step's ``reward`` (``null`` counts 0) is credited to that turn.

Failures are :class:`~asyncrl.errors.EpisodeFailure` with one line naming the server: an unreachable
server, a refused handshake (its HTTP status), a session the server closed (killed mid-episode) or
an ``error`` answer are ``env_error``; no answer within ``timeout_s`` is ``env_timeout``. A call
abandoned half way (a timeout, a cancelled episode) leaves the session out of step: later calls fail
rather than read another call's answer. ``episode.step_timeout_s`` bounds every call as well.

Credentials: ``token`` (or the environment variable named by ``token_env``, or the URL's password,
``http://:TOKEN@host``) is sent as ``Authorization: Bearer`` in the handshake, as gateways in front
of OpenEnv servers (a private Hugging Face Space) want; OpenEnv's server itself checks none. It never
appears in a message (those name the URL without its user and password).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import inspect
import json
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

from asyncrl.data import import_by_path
from asyncrl.errors import EpisodeFailure, UserError
from asyncrl.net import backoff_s
from asyncrl.service.client import without_credentials

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

# OpenEnv's own client accepts messages up to 100 MiB (observations may carry screenshots); the same
# here, so a server that works with OpenEnv's client works with this one.
MAX_MESSAGE_BYTES = 100 * 1024 * 1024
# The closing handshake of a session: the server answers at once unless it is stuck, and a stuck
# server must not hold the episode's end (the socket is dropped after this).
CLOSE_TIMEOUT_S = 2.0
_LOOPBACK = ("localhost", "127.0.0.1", "::1")


class EchoAdapter:
    """The default adapter: the model's text is the action's ``message`` (OpenEnv's echo environment);
    the model reads the observation's ``echoed_message``, else its only text field, else its JSON."""

    def action(self, text: str, task: dict) -> dict:
        return {"message": text}

    def observation(self, obs: dict) -> str:
        if isinstance(obs.get("echoed_message"), str):
            return obs["echoed_message"]
        texts = [v for v in obs.values() if isinstance(v, str)]
        return texts[0] if len(texts) == 1 else json.dumps(obs, sort_keys=True, separators=(",", ":"))


class _AtCapacity(Exception):
    """The server holds all the sessions it may (a ``CAPACITY_REACHED`` answer)."""


class OpenEnvEnv:
    """One episode's session on an OpenEnv server (see the module docstring). Options of ``episode.options``:

    ``url``: the server (``http(s)://`` or ``ws(s)://``; its WebSocket endpoint is ``<url>/ws``);
    ``adapter``: ``'module:name'`` of the adapter; ``timeout_s``: limit of the handshake and of each
    answer (None: only ``episode.step_timeout_s``); ``session_wait_s``: how long ``reset`` waits for a
    full server to free a session; ``token`` / ``token_env`` / ``headers``: sent in the handshake.
    """

    def __init__(
        self,
        url: str,
        adapter: str | None = None,
        timeout_s: float | None = None,
        session_wait_s: float = 10.0,
        token: str | None = None,
        token_env: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        if importlib.util.find_spec("websockets") is None:
            raise UserError("OpenEnvEnv needs the websockets package: pip install 'websockets>=15.0.1'")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
            raise UserError(
                f"OpenEnvEnv url {without_credentials(url)!r} is not an http(s):// or ws(s):// URL of a server"
            )
        if (timeout_s is not None and timeout_s <= 0) or session_wait_s < 0:
            raise UserError("OpenEnvEnv needs timeout_s > 0 (or None) and session_wait_s >= 0")
        scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
        self.url = urlunsplit((scheme, parts.netloc.rpartition("@")[2], parts.path.rstrip("/") + "/ws", "", ""))
        self.timeout_s, self.session_wait_s = timeout_s, session_wait_s
        self.adapter = EchoAdapter() if adapter is None else _load_adapter(adapter)
        self._headers = dict(headers or {})
        secret = token or (os.environ.get(token_env) if token_env else None) or unquote(parts.password or "")
        if token_env and not secret:
            raise UserError(f"OpenEnvEnv token_env names ${token_env}, which is not set")
        if secret:
            self._headers["Authorization"] = f"Bearer {secret}"
        self._proxy = None if parts.hostname in _LOOPBACK else True  # no proxy can reach our loopback
        self._ws: ClientConnection | None = None
        self._pending = False  # a request went out and its answer was never read: the session is out of step
        self._task: dict = {}

    def __repr__(self) -> str:
        return f"OpenEnvEnv({self.url!r}, timeout_s={self.timeout_s})"

    # -- the Env protocol ------------------------------------------------------------------------------
    async def reset(self, task: dict, seed: int) -> str | None:
        """Open this episode's session (unless open) and start it; the adapter's text of the first observation."""
        self._task = task
        hook = getattr(self.adapter, "reset_kwargs", None)
        data = hook(task, seed) if hook is not None else {"seed": seed}
        _check_dict(data, "reset_kwargs")
        answer = await self._reset({"type": "reset", "data": data})
        return self._text(answer["observation"])

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        """The model's turn as the adapter's action -> (its text of the observation, the server's reward,
        done, info: the server's answer)."""
        data = self.adapter.action(action, self._task)
        _check_dict(data, "action")
        answer = await self._call({"type": "step", "data": data}, "step")
        reward = answer.get("reward")
        return self._text(answer["observation"]), float(reward or 0.0), bool(answer.get("done")), answer

    async def close(self) -> None:
        """End the session (the server closes its environment); never fails."""
        ws, self._ws = self._ws, None
        if ws is None:
            return
        with contextlib.suppress(Exception):  # a session already gone needs no goodbye
            await ws.send(json.dumps({"type": "close"}))  # the server then leaves its loop and closes cleanly
        with contextlib.suppress(Exception):  # the socket is dropped whatever the handshake's fate
            await ws.close()

    # -- the session -------------------------------------------------------------------------------------
    async def _reset(self, message: dict) -> dict:
        """``message`` on this episode's session, opening one first; waits out a full server."""
        if self._ws is not None:
            return await self._call(message, "reset")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.session_wait_s
        attempt = 0
        while True:
            self._ws, self._pending = await self._connect(), False
            try:
                return await self._call(message, "reset")
            except _AtCapacity as full:
                await self.close()
                delay = backoff_s(attempt, 0.05, 1.0)
                if loop.time() + delay > deadline:
                    raise EpisodeFailure(
                        "env_error",
                        f"OpenEnv server {self.url} stayed at capacity ({full}) for {self.session_wait_s:g} s: "
                        "every running episode holds a session; raise the server's max_concurrent_envs",
                    ) from None
                attempt += 1
                await asyncio.sleep(delay)

    async def _connect(self) -> ClientConnection:
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidStatus, WebSocketException

        try:
            return await connect(
                self.url,
                additional_headers=self._headers,
                proxy=self._proxy,
                open_timeout=self.timeout_s,
                ping_interval=None,  # every call is bounded by its timeout; the server pings idle sessions
                close_timeout=CLOSE_TIMEOUT_S,
                max_size=MAX_MESSAGE_BYTES,
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            body = " ".join(bytes(exc.response.body or b"").decode(errors="replace").split())[:200]
            hint = " (no OpenEnv /ws endpoint at that URL?)" if status in (403, 404) else ""
            raise EpisodeFailure(
                "env_error", f"OpenEnv server {self.url} refused the session: HTTP {status}{hint} {body}".rstrip()
            ) from None
        except TimeoutError:
            raise EpisodeFailure(
                "env_timeout", f"OpenEnv server {self.url} did not open a session within {self.timeout_s:g} s"
            ) from None
        except (OSError, WebSocketException) as exc:
            raise EpisodeFailure("env_error", f"cannot reach OpenEnv server {self.url}: {_one_line(exc)}") from None

    async def _call(self, message: dict, kind: str) -> dict:
        """One request and its answer's ``data`` (``observation``, ``reward``, ``done``)."""
        from websockets.exceptions import ConnectionClosed

        if self._ws is None:
            raise EpisodeFailure("env_error", f"{kind} without an OpenEnv session (reset first) at {self.url}")
        if self._pending:
            raise EpisodeFailure("env_error", f"OpenEnv session at {self.url} out of step (a call was abandoned)")
        frame = json.dumps(message)
        self._pending = True
        try:
            async with asyncio.timeout(self.timeout_s):
                try:
                    await self._ws.send(frame)
                except ConnectionClosed:
                    pass  # a server that closed may have said why first: read it below
                raw = await self._ws.recv()
        except TimeoutError:
            raise EpisodeFailure(
                "env_timeout", f"OpenEnv server {self.url} did not answer {kind} within {self.timeout_s:g} s"
            ) from None
        except ConnectionClosed as exc:
            raise EpisodeFailure(
                "env_error", f"OpenEnv server {self.url} closed the session during {kind}: {_closed(exc)}"
            ) from None
        self._pending = False
        return self._judge(raw, kind)

    def _judge(self, raw: str | bytes, kind: str) -> dict:
        """The ``data`` of an ``observation`` answer; :class:`EpisodeFailure` for anything else."""
        try:
            answer = json.loads(raw)
        except json.JSONDecodeError:
            raise EpisodeFailure("env_error", f"OpenEnv server {self.url} answered {kind} with non-JSON") from None
        kind_of = answer.get("type") if isinstance(answer, dict) else None
        data = answer.get("data") if isinstance(answer, dict) else None
        if kind_of == "error" and isinstance(data, dict):
            if data.get("code") == "CAPACITY_REACHED":
                raise _AtCapacity(f"{data.get('active_sessions')} of {data.get('max_sessions')} sessions")
            raise EpisodeFailure("env_error", f"OpenEnv server {self.url} failed {kind}: {_error_text(data)}")
        if kind_of != "observation" or not isinstance(data, dict) or not isinstance(data.get("observation"), dict):
            raise EpisodeFailure("env_error", f"OpenEnv server {self.url} answered {kind} with {str(raw)[:120]!r}")
        return data

    def _text(self, observation: dict) -> str:
        text = self.adapter.observation(observation)
        if not isinstance(text, str):
            raise EpisodeFailure("env_error", f"the adapter's observation() returned {type(text).__name__}, not str")
        return text


@functools.lru_cache(maxsize=16)
def _load_adapter(spec: str) -> Any:
    """The adapter ``spec`` names (a class is built once with no arguments), checked for its methods."""
    adapter = import_by_path(spec)
    if inspect.isclass(adapter):
        adapter = adapter()
    for name in ("action", "observation"):
        if not callable(getattr(adapter, name, None)):
            raise UserError(f"OpenEnv adapter {spec!r} has no {name}() method (see asyncrl.episodes.openenv)")
    return adapter


def _check_dict(value: Any, method: str) -> None:
    if not isinstance(value, dict):
        raise EpisodeFailure("env_error", f"the adapter's {method}() returned {type(value).__name__}, not a dict")


def _error_text(data: dict) -> str:
    """``CODE: message`` of an error answer, with the first validation error's field: one line."""
    text = f"{data.get('code', 'ERROR')}: {data.get('message', '')}"
    errors = data.get("errors")
    if isinstance(errors, list) and errors and isinstance(errors[0], dict):
        first = errors[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        text += f" ({where}: {first.get('msg', '')}" + (f"; {len(errors) - 1} more)" if len(errors) > 1 else ")")
    return " ".join(text.split())[:300]


def _closed(exc: Exception) -> str:
    """Why a connection closed, in words (1006: dropped without a closing handshake, e.g. a killed server)."""
    rcvd = getattr(exc, "rcvd", None)
    if rcvd is None:
        return "the connection dropped (no close frame: the server died or the network failed)"
    return f"closed with code {rcvd.code}" + (f" ({rcvd.reason})" if rcvd.reason else "")


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
