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

Client policy (the kit's retrying client, :mod:`asyncrl.service.client`). ``timeout_s`` bounds one
logical call, queueing for a connection slot, every attempt and back-off included: when it runs out
the call raises ``EpisodeFailure("reward_timeout")``. A connect error, a dropped connection, 429 and
5xx are retried up to ``retries`` times with jittered exponential back-off (``asyncrl.net.backoff_s``:
``min(5 s, backoff_s * 2**attempt)``, times 0.5-1.0, attempts counted from 0); nothing else is (a
4xx or an ``error`` answer would only fail again). At most ``concurrency`` requests of one client
are in flight at once (its connection pool holds that many), so a burst of episodes cannot flood the
server. Every failure is an :class:`EpisodeFailure` (``reward_error`` or the server's cause), never a
reward of 0.

The token comes from ``token=``, else the URL's password (``http://:TOKEN@host:port/score``), else
the environment variable ``ASYNCRL_REWARD_TOKEN``. It is sent only in the Authorization header and
never appears in a repr, log line or error detail (those name the URL without credentials).

Concurrency: a client's HTTP session (its connection pool) belongs to the event loop that made it; a
call from another loop makes that loop its own. A session closes with ``close()`` (or ``async with``)
on its loop, else when that loop shuts its async generators down (``asyncio.run`` does).
"""

from __future__ import annotations

import asyncio
import uuid
from urllib.parse import urlsplit

from asyncrl.errors import EpisodeFailure, UserError
from asyncrl.service.client import CallFailed, JsonClient, LoopSessions, Unanswered, bearer_token, without_credentials

SCHEMA = "asyncrl.reward"
VERSION = 1
TOKEN_ENV = "ASYNCRL_REWARD_TOKEN"
# Causes a server may name in an ``error`` answer; anything else is reported as reward_error.
SERVER_CAUSES = ("reward_error", "reward_timeout", "reward_invalid")
# Longest single back-off: past a few seconds a server is down, not busy, and the episode's time is
# better spent failing.
_MAX_BACKOFF_S = 5.0


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
            raise UserError(f"{without_credentials(url)!r} is not an http(s)://host[:port]/path URL")
        if timeout_s <= 0 or retries < 0 or concurrency < 1 or backoff_s < 0:
            raise UserError("RemoteReward needs timeout_s > 0, retries >= 0, concurrency >= 1, backoff_s >= 0")
        self.url = without_credentials(url)  # what requests go to, and what messages name
        self.timeout_s, self.retries, self.concurrency, self.backoff_s = timeout_s, retries, concurrency, backoff_s
        self._token = bearer_token(url, TOKEN_ENV, token)
        if not self._token:
            raise UserError(
                f"no token for the reward server at {self.url}: put it in the URL (http://:TOKEN@host:port/path) "
                f"or in ${TOKEN_ENV} (asyncrl reward-serve prints where its token file is)"
            )
        self._sessions = LoopSessions(concurrency)  # this client's own connection pool on each loop
        self._client = JsonClient(
            self.url,
            self._token,
            self._sessions,
            schema=SCHEMA,
            version=VERSION,
            base_s=backoff_s,
            cap_s=_MAX_BACKOFF_S,
            retries=retries,
        )

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r}, timeout_s={self.timeout_s:g}, retries={self.retries})"

    async def __call__(self, prompt: str, completion: str, record: dict) -> float | dict[str, float]:
        request_id = uuid.uuid4().hex  # one per logical request, reused by its retries
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        fields = {"prompt": prompt, "completion": completion, "record": record}
        try:
            answer = await self._client.request("", request_id, fields, deadline)
        except Unanswered as exc:
            if exc.timed_out:
                raise EpisodeFailure(
                    "reward_timeout", f"no answer from {self.url} within {self.timeout_s:g} s"
                ) from None
            raise EpisodeFailure(
                "reward_error", f"{self.url} failed {exc.attempts} attempt(s); last: {exc.last}"
            ) from None
        except CallFailed as exc:
            raise EpisodeFailure("reward_error", str(exc)) from None
        return self._judge(answer, request_id)

    async def close(self) -> None:
        """Close this loop's HTTP session (also on ``async with`` exit); a later call opens a new one."""
        await self._sessions.close()

    async def __aenter__(self) -> RemoteReward:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

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
