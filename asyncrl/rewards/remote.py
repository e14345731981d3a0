"""A reward computed by a remote server over HTTP: the client side of ``asyncrl reward-serve``.

``data.reward: http://:TOKEN@HOST:PORT/score`` makes the generator call :class:`RemoteReward`.

Protocol ``asyncrl.reward`` version 1 (JSON over HTTP/1.1, UTF-8)::

    POST /score
    Authorization: Bearer <token>
    Content-Type: application/json

    {"schema": "asyncrl.reward", "version": 1,
     "id": str,            # 1-128 chars, one per logical request; every retry of it sends the same id
     "prompt": str, "completion": str,
     "record": {...}}      # the dataset record, as JSON

    200 {"schema": "asyncrl.reward", "version": 1, "id": <the request's id>,
         and exactly one of
         "reward": number                  # a plain reward
         "parts": {name: number, ...}      # a reward in named parts (their sum is the reward)
         "error": str, "cause": str}       # the reward could not be computed (one line); cause is
                                           # reward_error, reward_timeout (the server's deadline) or
                                           # reward_invalid (the function returned a non-number)

    400 bad request (not JSON, nested deeper than 64 levels, another schema or version, an unknown
        field, a field of the wrong type)
    401 no or wrong token     408 the body did not arrive within the read deadline (5 s + size at 1 MiB/s)
    409 the id was seen with a different request     413 body too large
    429 too many pending requests     503 shutting down     other 5xx: the server failed
    (a non-200 body is {"error": str}, or plain text from the HTTP layer itself)

Idempotence: a server keeps recent answers by id (``error`` answers too) and answers a repeated id
from that cache without calling the reward again, also while the first call still runs. A retry
therefore computes nothing twice (unless the server restarted in between), so retrying is safe
whatever the reward costs.

Client policy. ``timeout_s`` bounds one logical call, queueing for a connection slot, every attempt
and back-off included: when it runs out the call raises ``EpisodeFailure("reward_timeout")``. A
connect error, a dropped connection, 429 and 5xx are retried up to ``retries`` times with jittered
exponential back-off (``asyncrl.net.backoff_s``: ``min(5 s, backoff_s * 2**attempt)``, times 0.5-1.0,
attempts counted from 0); nothing else is (a
4xx or an ``error`` answer would only fail again). At most ``concurrency`` requests of one client
are in flight at once (an ``asyncio.Semaphore``), so a burst of episodes cannot flood the server.
Every failure is an :class:`EpisodeFailure` (``reward_error`` or the server's cause), never a
reward of 0.

The token comes from ``token=``, else the URL's password (``http://:TOKEN@host:port/score``), else
the environment variable ``ASYNCRL_REWARD_TOKEN``. It is sent only in the Authorization header and
never appears in a repr, log line or error detail (those name the URL without credentials).

Concurrency: one client serves one event loop at a time; its HTTP session and semaphore belong to
the loop that first used them, and a call from another loop makes fresh ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from urllib.parse import unquote, urlsplit, urlunsplit

from asyncrl.errors import EpisodeFailure, UserError
from asyncrl.net import backoff_s

SCHEMA = "asyncrl.reward"
VERSION = 1
TOKEN_ENV = "ASYNCRL_REWARD_TOKEN"
# Causes a server may name in an ``error`` answer; anything else is reported as reward_error.
SERVER_CAUSES = ("reward_error", "reward_timeout", "reward_invalid")
# Longest single back-off: past a few seconds a server is down, not busy, and the episode's time is
# better spent failing.
_MAX_BACKOFF_S = 5.0


class _Retryable(Exception):
    """An attempt that failed in a way a retry may fix (connection, 429, 5xx)."""


class RemoteReward:
    """``await RemoteReward(url, timeout_s=...)(prompt, completion, record)``: a reward from a server."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        retries: int = 3,
        concurrency: int = 16,
        backoff_s: float = 0.2,
        token: str | None = None,
    ):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserError(f"{redact(url)!r} is not an http(s)://host[:port]/path URL")
        if timeout_s <= 0 or retries < 0 or concurrency < 1 or backoff_s < 0:
            raise UserError("RemoteReward needs timeout_s > 0, retries >= 0, concurrency >= 1, backoff_s >= 0")
        self.url = redact(url)  # what requests go to, and what messages name
        self.timeout_s, self.retries, self.concurrency, self.backoff_s = timeout_s, retries, concurrency, backoff_s
        self._token = token or (unquote(parts.password) if parts.password else None) or os.environ.get(TOKEN_ENV)
        if not self._token:
            raise UserError(
                f"no token for the reward server at {self.url}: put it in the URL (http://:TOKEN@host:port/path) "
                f"or in ${TOKEN_ENV} (asyncrl reward-serve prints where its token file is)"
            )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session = None  # aiohttp.ClientSession of self._loop
        self._slots: asyncio.Semaphore | None = None

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r}, timeout_s={self.timeout_s:g}, retries={self.retries})"

    async def __call__(self, prompt: str, completion: str, record: dict) -> float | dict[str, float]:
        request_id = uuid.uuid4().hex  # one per logical request, reused by its retries
        try:
            body = json.dumps(
                {
                    "schema": SCHEMA,
                    "version": VERSION,
                    "id": request_id,
                    "prompt": prompt,
                    "completion": completion,
                    "record": record,
                },
                allow_nan=False,
            ).encode()
        except (TypeError, ValueError) as exc:
            raise EpisodeFailure("reward_error", f"the request is not JSON: {exc}") from None
        try:
            async with asyncio.timeout(self.timeout_s):
                answer = await self._post_with_retries(body)
        except TimeoutError:
            raise EpisodeFailure("reward_timeout", f"no answer from {self.url} within {self.timeout_s:g} s") from None
        return self._judge(answer, request_id)

    async def close(self) -> None:
        """Close the HTTP session (also on ``async with`` exit); a later call opens a new one."""
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = self._loop = self._slots = None

    async def __aenter__(self) -> RemoteReward:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ----- one logical request --------------------------------------------------------------

    async def _post_with_retries(self, body: bytes) -> dict:
        """The server's 200 answer to ``body``; retries what a retry may fix (see the module doc)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        attempts = self.retries + 1
        for attempt in range(attempts):
            try:
                return await self._post(body)
            except _Retryable as exc:
                last = str(exc)
            delay = backoff_s(attempt, self.backoff_s, _MAX_BACKOFF_S)
            if attempt == attempts - 1 or loop.time() + delay >= deadline:
                break  # no retry left, or none that could finish in time
            await asyncio.sleep(delay)
        raise EpisodeFailure("reward_error", f"{self.url} failed {attempt + 1} attempt(s); last: {last}")

    async def _post(self, body: bytes) -> dict:
        """One attempt: the answer of a 200; :class:`_Retryable` or :class:`EpisodeFailure` otherwise."""
        import aiohttp

        session, slots = self._session_for_loop()
        headers = {"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"}
        async with slots:
            try:
                async with session.post(self.url, data=body, headers=headers) as resp:
                    status, text = resp.status, await resp.text(errors="replace")
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                raise _Retryable(f"{type(exc).__name__}: {exc}") from None
        if status == 200:
            try:
                answer = json.loads(text)
            except json.JSONDecodeError:
                raise EpisodeFailure("reward_error", f"{self.url} answered 200 with non-JSON {text[:80]!r}") from None
            if not isinstance(answer, dict):
                raise EpisodeFailure("reward_error", f"{self.url} answered a {type(answer).__name__}, not an object")
            return answer
        reason = f"HTTP {status}: {_error_text(text)}"
        if status == 429 or status >= 500:
            raise _Retryable(reason)
        raise EpisodeFailure("reward_error", f"{self.url} refused the request ({reason})")

    def _session_for_loop(self):
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._session is None or self._session.closed:
            self._loop = loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.concurrency),
                timeout=aiohttp.ClientTimeout(total=None),  # the call's own deadline bounds every attempt
            )
            self._slots = asyncio.Semaphore(self.concurrency)
        return self._session, self._slots

    def _judge(self, answer: dict, request_id: str) -> float | dict[str, float]:
        """The reward in a 200 answer; :class:`EpisodeFailure` for an ``error`` or malformed answer."""
        where = self.url
        if answer.get("schema") != SCHEMA or answer.get("version") != VERSION:
            got = f"{answer.get('schema')!r} version {answer.get('version')!r}"
            raise EpisodeFailure("reward_error", f"{where} answered {got}, not {SCHEMA!r} version {VERSION}")
        if answer.get("id") != request_id:
            raise EpisodeFailure("reward_error", f"{where} answered id {answer.get('id')!r:.40}, not the request's")
        if "error" in answer:
            cause = answer.get("cause")
            cause = cause if cause in SERVER_CAUSES else "reward_error"
            raise EpisodeFailure(cause, f"reward server: {str(answer['error'])[:500]}")
        if "reward" in answer:
            return answer["reward"]  # asyncrl.rewards.resolve.score judges the value itself
        if isinstance(answer.get("parts"), dict):
            return answer["parts"]
        raise EpisodeFailure("reward_error", f"{where} answered with none of 'reward', 'parts', 'error'")


def redact(url: str) -> str:
    """``url`` without its userinfo (user and token)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _error_text(text: str) -> str:
    """The ``error`` of a non-200 JSON body, else the body's start: one line."""
    try:
        body = json.loads(text)
        text = str(body["error"]) if isinstance(body, dict) and "error" in body else text
    except json.JSONDecodeError:
        pass
    return " ".join(text.split())[:200] or "(empty body)"
