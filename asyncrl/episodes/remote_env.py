"""An environment served by ``asyncrl env-serve``: the client side of protocol ``asyncrl.env`` version 1.

``episode.env_url: http://:TOKEN@HOST:PORT`` makes every episode play a :class:`RemoteEnv`: its own
session on the server, opened at ``reset`` and closed with the episode. The protocol is documented
in :mod:`asyncrl.episodes.env_serve` (and ``docs/environments.md``).

Client policy (the kit's retrying client, :mod:`asyncrl.service.client`). ``timeout_s`` bounds one
logical call (``reset`` opens the session too, under the same bound), every attempt and back-off
included. A connect error, a dropped connection, 408, 429 and 5xx are retried with jittered
exponential back-off (``asyncrl.net.backoff_s``, 0.1 s doubling up to 2 s) under the SAME request id,
so a retry of a step whose answer was lost never steps twice: the server answers it from its cache.
Nothing else is retried. Failures are
:class:`~asyncrl.errors.EpisodeFailure`:

* an environment fault answered by the server: its cause (``env_error``, ``env_timeout``,
  ``env_crash``, ``env_memory``, ``env_lost``) and its one-line detail;
* 404 for the session (closed, its lease expired, or the server restarted): ``env_lost``;
* no answer in time from a server that took the request: ``env_timeout``; a server not reachable
  until the deadline: ``env_error`` naming the URL (without its token).

After a server restart the old sessions are gone (``env_lost``) and the next episode simply opens a
new one.

Resuming. A session outlives its client: :meth:`RemoteEnv.journal` is what another process needs to go
on with it (the session id, and the request id the next step will use, fixed before the step is sent),
and :meth:`RemoteEnv.resume` takes it up. A step that was sent by a generator that died before the
answer came is sent again by the resumer under the same id, so the environment steps once.

The token comes from the URL's password, else ``$ASYNCRL_ENV_TOKEN``; it is sent only in the
Authorization header, never in a message or repr.

Concurrency: a RemoteEnv belongs to one episode on one event loop. Every RemoteEnv on a loop shares
one HTTP session (one connection pool), closed on that loop when the loop shuts its async generators
down (``asyncio.run`` does; ``loop.run_until_complete(loop.shutdown_asyncgens())`` before
``loop.close()`` elsewhere); a later call opens a new one.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any
from urllib.parse import urlsplit

from asyncrl.errors import EpisodeFailure, UserError
from asyncrl.net import redact_url
from asyncrl.service.client import (
    CallFailed,
    Declined,
    JsonClient,
    LoopSessions,
    Unanswered,
    bearer_token,
    without_credentials,
)

SCHEMA = "asyncrl.env"
VERSION = 1
TOKEN_ENV = "ASYNCRL_ENV_TOKEN"
# Causes a server may name in an environment fault; anything else is reported as env_error.
CAUSES = ("env_error", "env_timeout", "env_crash", "env_memory", "env_lost")
# Causes after which the server has ended the session (its worker is gone): nothing left to close.
ENDED = ("env_timeout", "env_crash", "env_memory", "env_lost")
DEFAULT_TIMEOUT_S = 30.0  # episode.step_timeout_s's default
# Back-off: an environment step is on the episode's critical path, so retries start fast; past 2 s a
# server is restarting or down, and a restart takes seconds.
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.1, 2.0
# The call's own deadline ends this share into timeout_s: the episode's step timer (the same timeout_s,
# started a moment earlier) would otherwise fire first and report a bare timeout instead of the reason.
OWN_SHARE = 0.98
CONNECTIONS = 256  # per event loop: above a generator's episodes in flight, below any descriptor limit
_SHARED = LoopSessions(CONNECTIONS)  # every RemoteEnv of a loop shares that loop's HTTP session


class RemoteEnv:
    """An :class:`~asyncrl.episodes.api.Env` whose instance lives in an ``asyncrl env-serve`` server."""

    def __init__(self, url: str, *, options: dict | None = None, timeout_s: float | None = None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserError(f"{redact_url(url)!r} is not an http(s)://host:port URL")
        self.url = redact_url(url)  # what messages name
        self.options = dict(options or {})
        self.timeout_s = timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S
        if self.timeout_s <= 0:
            raise UserError("RemoteEnv needs timeout_s > 0")
        self._token = bearer_token(url, TOKEN_ENV)
        if not self._token:
            raise UserError(
                f"no token for the environment server at {self.url}: put it in the URL (http://:TOKEN@host:port) "
                f"or in ${TOKEN_ENV} (asyncrl env-serve prints where its token file is)"
            )
        self._client = JsonClient(
            without_credentials(url).rstrip("/"),  # what requests go to
            self._token,
            _SHARED,
            schema=SCHEMA,
            version=VERSION,
            base_s=BACKOFF_BASE_S,
            cap_s=BACKOFF_CAP_S,
            retry_on=(408, 429),
            where=self.url,
        )
        self.session: str | None = None  # the server's session id, from reset until close
        self._ended = False  # the server ended the session (or cannot be reached): close sends nothing
        self._step_id = uuid.uuid4().hex  # the next step's request id (journaled before it is sent)

    def __repr__(self) -> str:
        return f"RemoteEnv({self.url!r}, timeout_s={self.timeout_s:g}, session={self.session!r})"

    async def reset(self, task: dict, seed: int) -> Any:
        """Open a session (the first time, or when the last one ended), then reset it; the first
        observation or None."""
        deadline = self._deadline()
        if self.session is None or self._ended:
            opened = await self._call("/sessions", {"options": self.options}, deadline)
            if not isinstance(opened.get("session"), str):
                raise EpisodeFailure("env_error", f"{self.url} opened a session without a 'session' id")
            self.session, self._ended = opened["session"], False
        answer = await self._call(f"/sessions/{self.session}/reset", {"task": task, "seed": seed}, deadline)
        return answer.get("observation")

    async def step(self, action: str) -> tuple[Any, Any, Any, Any]:
        """One model turn -> ``(observation, reward, done, info)`` from the server's environment."""
        if self.session is None:
            raise EpisodeFailure("env_error", "step() before reset()")
        try:
            answer = await self._call(
                f"/sessions/{self.session}/step", {"action": action}, self._deadline(), self._step_id
            )
        finally:
            self._step_id = uuid.uuid4().hex
        missing = [k for k in ("observation", "reward", "done", "info") if k not in answer]
        if missing:
            raise EpisodeFailure("env_error", f"{self.url} answered a step without {', '.join(missing)}")
        return answer["observation"], answer["reward"], answer["done"], answer["info"]

    def journal(self) -> dict | None:
        """What :meth:`resume` needs to go on with this session elsewhere; None before reset."""
        if self.session is None or self._ended:
            return None
        return {"session": self.session, "step_id": self._step_id}

    def resume(self, state: dict) -> None:
        """Go on with the session a :meth:`journal` describes (its next step under the journaled id)."""
        self.session, self._step_id, self._ended = str(state["session"]), str(state["step_id"]), False

    async def close(self) -> None:
        """Close the session (its environment's ``close()`` runs on the server). Idempotent."""
        session, self.session = self.session, None
        if session is None or self._ended:
            return
        try:
            await self._call(f"/sessions/{session}/close", {}, self._deadline())
        except EpisodeFailure as failure:
            if failure.cause not in ENDED:  # an ended session needs no closing
                raise

    # ----- one logical call ------------------------------------------------------------------------

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.timeout_s * OWN_SHARE

    async def _call(self, path: str, fields: dict, deadline: float, request_id: str | None = None) -> dict:
        """The server's answer to one request (its retries share its id); EpisodeFailure for a fault."""
        request_id = request_id or uuid.uuid4().hex
        try:
            answer = await self._client.request(path, request_id, fields, deadline)
        except Unanswered as exc:
            if exc.timed_out and exc.last is None:  # a server that took the request: close still tries
                raise EpisodeFailure("env_timeout", f"no answer from {self.url} within {self.timeout_s:g} s") from None
            self._ended = True  # a close would only wait as long again
            last = f"{exc.last}; then no answer" if exc.timed_out else exc.last
            raise EpisodeFailure(
                "env_error",
                f"unreachable: {self.url} in {self.timeout_s:g} s ({exc.attempts} attempt(s)); last: {last}",
            ) from None
        except Declined as exc:
            if exc.status == 404 and path != "/sessions":
                self._ended = True
                raise EpisodeFailure("env_lost", f"{self.url} no longer has the session ({exc.reason})") from None
            raise EpisodeFailure("env_error", str(exc)) from None
        except CallFailed as exc:
            raise EpisodeFailure("env_error", str(exc)) from None
        if answer.get("schema") != SCHEMA or answer.get("version") != VERSION or answer.get("id") != request_id:
            got = f"{answer.get('schema')!r} version {answer.get('version')!r}, id {str(answer.get('id'))[:40]!r}"
            raise EpisodeFailure("env_error", f"{self.url} answered {got}, not {SCHEMA!r} {VERSION} to its request")
        if "error" in answer:
            cause = answer.get("cause") if answer.get("cause") in CAUSES else "env_error"
            self._ended = self._ended or cause in ENDED
            raise EpisodeFailure(cause, f"environment server: {' '.join(str(answer['error']).split())[:500]}")
        return answer
