"""The retrying JSON-over-HTTP client of the run's servers (``asyncrl reward-serve``, ``asyncrl env-serve``).

A request is ``POST <url><path>`` with ``Authorization: Bearer <token>`` and the JSON body ``{"schema", "version",
"id", ...fields}``. The id names one logical request and is the caller's: every retry of the request sends the same
one, so a server that keeps recent answers by id answers a retry from its cache and never does the work twice.

Policy. One logical request has one deadline (a loop time), which bounds every attempt (queueing for a connection
included) and every back-off. A connect error, a dropped connection, 5xx and the statuses in ``retry_on`` (429;
the environment client adds 408) are retried with jittered exponential back-off (:func:`asyncrl.net.backoff_s`:
``min(cap, base * 2**n)`` times 0.5-1.0 before retry ``n``, counted from 0), at most ``retries`` times when that
is set, and only when the back-off ends before the deadline. Nothing else is retried: another 4xx, or a 200 that
is not a JSON object, would only fail again. Each failure is a :class:`CallFailed` with one line that names the
server without credentials (never the token); the caller turns it into a failure cause of its own.

Sessions. :class:`LoopSessions` holds one ``aiohttp.ClientSession`` (one connection pool, ``connections``
connections at most, so at most that many requests in flight) per event loop for every client that shares it. A
session is closed on its own loop, as aiohttp requires: by :meth:`LoopSessions.close`, or when the loop shuts its
async generators down (``asyncio.run`` does; ``loop.run_until_complete(loop.shutdown_asyncgens())`` before
``loop.close()`` elsewhere). A later request opens a new one.
"""

from __future__ import annotations

import asyncio
import json
import os
import weakref
from collections.abc import AsyncIterator
from urllib.parse import unquote, urlsplit, urlunsplit

from asyncrl.net import backoff_s


class CallFailed(Exception):
    """A request without a usable answer; ``str()`` is one line naming the server (never its token)."""


class Declined(CallFailed):
    """A non-200 answer a retry would not change: its ``status`` and ``reason`` (``HTTP <status>: <error text>``)."""

    def __init__(self, where: str, status: int, reason: str):
        super().__init__(f"{where} refused the request ({reason})")
        self.status, self.reason = status, reason


class Unanswered(CallFailed):
    """No answer before the deadline or the last retry: ``attempts`` that failed in a way a retry may fix, the
    ``last`` of those failures (None without any), and whether the request ended on an attempt that ran out of
    time (``timed_out``) rather than on a retry that was not made."""

    def __init__(self, where: str, attempts: int, last: str | None, *, timed_out: bool):
        super().__init__(f"no answer from {where} ({attempts} attempt(s) failed; last: {last})")
        self.attempts, self.last, self.timed_out = attempts, last, timed_out


class _Retryable(Exception):
    """An attempt that failed in a way a retry may fix (a connection error, 5xx, a status in ``retry_on``)."""


class LoopSessions:
    """One ``aiohttp.ClientSession`` per event loop, shared by every client given this object (see the module
    doc); ``len()`` is how many loops hold one now."""

    def __init__(self, connections: int):
        self.connections = connections
        self._held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> (ClientSession, its closer)

    def __len__(self) -> int:
        return len(self._held)

    async def session(self):
        """This loop's ``aiohttp.ClientSession``, made on first use."""
        import aiohttp

        loop = asyncio.get_running_loop()
        held = self._held.get(loop)
        if held is not None and not held[0].closed:
            return held[0]
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.connections),
            timeout=aiohttp.ClientTimeout(total=None),  # each request's own deadline bounds every attempt
        )
        closer = self._closer(session)
        await closer.__anext__()  # runs to its yield at once: no other coroutine can make a second session
        self._held[loop] = (session, closer)
        return session

    async def close(self) -> None:
        """Close this loop's session now, if it has one."""
        held = self._held.get(asyncio.get_running_loop())
        if held is not None:
            await held[1].aclose()

    async def _closer(self, session) -> AsyncIterator[None]:
        """Holds ``session`` open; ending this generator (the loop's ``shutdown_asyncgens()``, or :meth:`close`)
        closes the session on its own loop."""
        try:
            yield
        finally:
            loop = asyncio.get_running_loop()
            if self._held.get(loop, (None,))[0] is session:
                del self._held[loop]
            await session.close()


class JsonClient:
    """Requests to one server (see the module doc). ``url`` is where they go (without credentials; a request's
    path is appended), ``where`` what messages name; ``base_s``/``cap_s`` shape the back-off."""

    def __init__(
        self,
        url: str,
        token: str,
        sessions: LoopSessions,
        *,
        schema: str,
        version: int,
        base_s: float,
        cap_s: float,
        retries: int | None = None,
        retry_on: tuple[int, ...] = (429,),
        where: str | None = None,
    ):
        self.url, self.where = url, where or url
        self.schema, self.version = schema, version
        self.base_s, self.cap_s, self.retries, self.retry_on = base_s, cap_s, retries, retry_on
        self._token, self._sessions = token, sessions

    async def request(self, path: str, request_id: str, fields: dict, deadline: float) -> dict:
        """The server's 200 answer (a JSON object) to ``fields`` under ``request_id``; :class:`CallFailed`
        otherwise. ``deadline`` is a time of the running loop."""
        try:
            message = {"schema": self.schema, "version": self.version, "id": request_id, **fields}
            body = json.dumps(message, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise CallFailed(f"the request is not JSON: {exc}") from None
        loop = asyncio.get_running_loop()
        attempts, last = 0, None
        while True:
            try:
                async with asyncio.timeout(deadline - loop.time()):  # a deadline already past times out at once
                    return await self._post(path, body)
            except TimeoutError:
                raise Unanswered(self.where, attempts, last, timed_out=True) from None
            except _Retryable as exc:
                attempts, last = attempts + 1, str(exc)
            delay = backoff_s(attempts - 1, self.base_s, self.cap_s)
            if (self.retries is not None and attempts > self.retries) or loop.time() + delay >= deadline:
                raise Unanswered(self.where, attempts, last, timed_out=False)  # no retry left, or none in time
            await asyncio.sleep(delay)

    async def _post(self, path: str, body: bytes) -> dict:
        """One attempt: the answer of a 200; :class:`_Retryable` or :class:`CallFailed` otherwise."""
        import aiohttp

        session = await self._sessions.session()
        headers = {"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"}
        try:
            async with session.post(self.url + path, data=body, headers=headers) as resp:
                status, text = resp.status, await resp.text(errors="replace")
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None
        if status == 200:
            try:
                answer = json.loads(text)
            except json.JSONDecodeError:
                raise CallFailed(f"{self.where} answered 200 with non-JSON {text[:80]!r}") from None
            if not isinstance(answer, dict):
                raise CallFailed(f"{self.where} answered a {type(answer).__name__}, not an object")
            return answer
        reason = f"HTTP {status}: {error_text(text)}"
        if status in self.retry_on or status >= 500:
            raise _Retryable(reason)
        raise Declined(self.where, status, reason)


def bearer_token(url: str, env: str, given: str | None = None) -> str | None:
    """The token to send: ``given``, else the URL's password, else ``$env``; None without any."""
    password = urlsplit(url).password
    return given or (unquote(password) if password else None) or os.environ.get(env)


def without_credentials(url: str) -> str:
    """``url`` without its userinfo (user and token)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def error_text(text: str) -> str:
    """The ``error`` of a non-200 JSON body, else the body's start: one line."""
    try:
        body = json.loads(text)
        text = str(body["error"]) if isinstance(body, dict) and "error" in body else text
    except json.JSONDecodeError:
        pass
    return " ".join(text.split())[:200] or "(empty body)"
