"""``asyncrl env-serve``: an environment class's sessions over HTTP, so environments scale on other machines
independently of the generators (``episode.env_url``; the client is :mod:`asyncrl.episodes.remote_env`).

    asyncrl env-serve --env asyncrl.demo.guess:Env --workers 8 --token-file env.token

Protocol ``asyncrl.env`` version 1 (JSON over HTTP/1.1, UTF-8; every request carries
``Authorization: Bearer <token>``; every POST body has ``"schema": "asyncrl.env", "version": 1`` and
``"id"``, 1-128 chars, one per logical request, the same on each of its retries)::

    POST /sessions                 {..., "options": {...}}        # the class's keyword arguments
      200 {"schema", "version", "id", "session": str, "lease_s": number}
    POST /sessions/<sid>/reset     {..., "task": {...}, "seed": int}
      200 {"schema", "version", "id", "observation": str | [int] | null}
    POST /sessions/<sid>/step      {..., "action": str}
      200 {"schema", "version", "id", "observation", "reward", "done": bool, "info": {...}}
    POST /sessions/<sid>/close     {...}                          # runs the environment's close()
      200 {"schema", "version", "id"}
    GET  /health
      200 {"schema", "version", "env", "sessions", counters by name, "faults": {cause: n}, "pool": {...}}

    A fault of the environment is a 200 answer {"schema", "version", "id", "error": one line, "cause"}:
    env_error (it raised, or its constructor did), env_timeout (no answer within --deadline-s: its worker
    was killed), env_crash (its worker died under this step, and again when run alone), env_memory (its
    worker passed --memory-mb) or env_lost (its worker died for another session and its replay failed:
    ``asyncrl.service.sessions``). After any cause but env_error the session is gone.
    400 not JSON, nested over 64 levels, another schema or version, an unknown, missing or mistyped field
    401 no or wrong token    404 no such session: closed, idle past its lease, or the server restarted
    408 the body did not arrive in time (5 s + its size at 1 MiB/s)    409 the id was seen with another
    request    413 body over 32 MiB    429 overloaded: retry later    503 shutting down
    (a non-200 body is {"error": str}, or plain text from the HTTP layer)

* **Idempotent by request id.** The answers of the last :data:`~asyncrl.service.http.CACHE_SIZE` ids
  (faults included) are kept; a repeated id with the same request is answered from there without
  stepping again, also while the first still computes (it awaits that same computation, which is not
  tied to its HTTP request). The same id with another request (or session) is 409.
* **Leases.** Every request to a session renews its lease; a session idle for ``--lease-s`` (no
  request, none computing) is closed, its environment's ``close()`` called and its worker slot freed,
  so the sessions of a generator that died do not leak. A live episode pauses between steps only for
  its model turn: keep the lease well above that.
* **User code never runs in this process.** Every session is built and driven in a
  :class:`~asyncrl.service.pool.WorkerPool` (``--workers`` processes, ``--threads`` calls each), plain
  and ``async`` classes alike (a session's coroutines run on its own loop in its worker): a hang is
  killed at ``--deadline-s``, and a crash ends only the sessions of its worker. A session's calls run
  one at a time, in arrival order. Keep ``--deadline-s`` under the clients' ``episode.step_timeout_s``;
  a worker imports the class as it starts, outside any call's deadline.
* **As** ``asyncrl reward-serve``, from the same service kit (:mod:`asyncrl.service.http`): loopback and
  a token by default (from ``--token-file``, made 0600 when missing, else ``$ASYNCRL_ENV_TOKEN``, else a
  temporary 0600 file removed at exit; only the file's path is printed), the read deadline, the nesting
  limit, the answer cache, exit code 2 for a class that cannot be imported, and SIGINT / SIGTERM exiting
  130 / 143, after the open sessions were closed and the workers killed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from asyncrl.episodes.remote_env import CAUSES, ENDED, SCHEMA, TOKEN_ENV, VERSION
from asyncrl.errors import EpisodeFailure, UserError
from asyncrl.service.http import (
    Answers,
    Door,
    Refused,
    announce,
    check_request,
    digest_of,
    listening,
    new_app,
    reply,
    serve_until_signal,
)
from asyncrl.service.pool import WorkerPool

log = logging.getLogger("asyncrl.episodes.env_serve")

MAX_SESSIONS = 100_000  # open sessions; past this opening one is answered 429
READY_TIMEOUT_S = 120.0  # a worker's start and import of the class: a heavy module can take this long
SHUTDOWN_CLOSE_S = 5.0  # at a signal, the sessions' close() calls together get this long, then workers are killed
_OPS = {  # a request's fields (besides schema, version, id) and their JSON types, by operation
    "open": {"options": dict},
    "reset": {"task": dict, "seed": int},
    "step": {"action": str},
    "close": {},
}
_OPTIONAL = {"options"}


@dataclasses.dataclass(eq=False)
class _Session:
    sid: str
    handle: Any  # the pool's Session
    last: float  # loop time of its last request or answer: the lease runs from here
    busy: int = 0  # requests queued or computing: it never expires while one is
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)  # one call at a time, in order


def describe_env(spec: str) -> None:
    """Run in a pool worker at start-up: import ``spec`` there (never in the server) and check that it
    is an environment class."""
    import importlib
    import inspect

    module, _, qualname = spec.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not inspect.isclass(obj) or not all(callable(getattr(obj, m, None)) for m in ("reset", "step")):
        raise TypeError(f"{spec} is not an environment class (one with reset() and step())")


class EnvService:
    """The protocol over a :class:`WorkerPool`: sessions, their leases, the answer cache."""

    def __init__(self, pool: WorkerPool, env: str, token: str, *, deadline_s: float, lease_s: float):
        self.pool, self.env, self.deadline_s, self.lease_s = pool, env, deadline_s, lease_s
        self.door = Door(token)
        self.answers = Answers(SCHEMA, VERSION)
        self.sessions: dict[str, _Session] = {}
        names = ("opened", "closed", "expired", "ended", "resets", "steps")
        self.counts = collections.Counter(dict.fromkeys(names, 0))
        self.faults: collections.Counter[str] = collections.Counter()
        self._tasks: set[asyncio.Task] = set()  # background closes and the lease keeper

    def app(self):
        app = new_app()
        app.router.add_get("/health", self.health)
        app.router.add_post("/sessions", self.open)
        app.router.add_post("/sessions/{sid}/{op}", self.session_op)
        return app

    # ----- handlers ----------------------------------------------------------------------------------

    async def health(self, request):
        if not self.door.authorized(request):
            return Refused(401, "missing or wrong bearer token").response()
        counts = {"sessions": len(self.sessions), "computing": len(self.answers.computing), **self.counts}
        counts["repeats"] = self.answers.repeats  # requests answered from the cache
        head = {"schema": SCHEMA, "version": VERSION, "env": self.env}
        return reply({**head, **counts, "faults": dict(self.faults), "pool": self.pool.stats()})

    async def open(self, request):
        try:
            msg = await self.door.message(request, functools.partial(check_op, op="open"))

            def start():
                if len(self.sessions) >= MAX_SESSIONS:
                    raise Refused(429, f"{len(self.sessions)} sessions open; retry later")
                return self._open(msg.get("options", {}))

            return await self.answers.answer(msg["id"], _digest("open", "", msg), start)
        except Refused as refused:
            return refused.response()

    async def session_op(self, request):
        sid, op = request.match_info["sid"], request.match_info["op"]
        try:
            if not self.door.authorized(request):
                raise Refused(401, "missing or wrong bearer token")
            if op not in ("reset", "step", "close"):
                raise Refused(404, f"no operation {op!r}: a session has reset, step and close")
            msg = await self.door.message(request, functools.partial(check_op, op=op))
            session = self.sessions.get(sid)
            if session is not None:
                session.last = asyncio.get_running_loop().time()  # every request renews the lease

            def start():
                if session is None or self.sessions.get(sid) is not session:
                    raise Refused(404, f"no session {sid[:64]!r}: closed, idle past its lease, or the server restarted")
                session.busy += 1
                if op == "close":
                    del self.sessions[sid]
                    self.counts["closed"] += 1
                return self._run(session, op, msg)

            return await self.answers.answer(msg["id"], _digest(op, sid, msg), start)
        except Refused as refused:
            return refused.response()

    # ----- sessions ----------------------------------------------------------------------------------

    async def _open(self, options: dict) -> dict:
        try:
            handle = await self.pool.open(self.env, options, timeout_s=self.deadline_s, kind="env")
        except EpisodeFailure as failure:
            return self._fault(failure)
        sid = secrets.token_hex(16)
        self.sessions[sid] = _Session(sid, handle, asyncio.get_running_loop().time())
        self.counts["opened"] += 1
        return {"session": sid, "lease_s": self.lease_s}

    async def _run(self, session: _Session, op: str, msg: dict) -> dict:
        """``op`` on ``session`` (its ``busy`` already counted), after the calls that came before it."""
        try:
            async with session.lock:
                if op == "close":
                    await session.handle.close(timeout_s=self.deadline_s)
                    return {}
                if op == "reset":
                    observation = await session.handle.call(
                        "reset", [msg["task"], msg["seed"]], timeout_s=self.deadline_s
                    )
                    self.counts["resets"] += 1
                    return {"observation": observation}
                result = await session.handle.call("step", [msg["action"]], timeout_s=self.deadline_s)
                self.counts["steps"] += 1
                return step_answer(result)
        except EpisodeFailure as failure:
            if failure.cause in ENDED and self.sessions.pop(session.sid, None) is session:
                self.counts["ended"] += 1
                with contextlib.suppress(EpisodeFailure):
                    await session.handle.close(timeout_s=self.deadline_s)  # the pool forgets it; nothing is sent
            return self._fault(failure)
        finally:
            session.busy -= 1
            session.last = asyncio.get_running_loop().time()

    def _fault(self, failure: EpisodeFailure) -> dict:
        """A fault answer; a cause outside the protocol's (the user's own EpisodeFailure) is env_error."""
        cause, detail = failure.cause, failure.detail or failure.cause
        if cause not in CAUSES:
            cause, detail = "env_error", f"{failure.cause}: {detail}"
        self.faults[cause] += 1
        return {"error": " ".join(detail.split())[:1000], "cause": cause}

    async def keep_leases(self) -> None:
        """Close every session idle past its lease; checks a quarter-lease (at most 1 s) apart."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.lease_s / 4))
            now = loop.time()
            for session in [s for s in self.sessions.values() if not s.busy and now - s.last > self.lease_s]:
                del self.sessions[session.sid]
                self.counts["expired"] += 1
                log.info("session %s idle for %.0f s, past its lease: closing it", session.sid, now - session.last)
                self._track(self._close_quietly(session))

    async def _close_quietly(self, session: _Session) -> None:
        async with session.lock:
            try:
                await session.handle.close(timeout_s=self.deadline_s)
            except EpisodeFailure as failure:
                log.warning("session %s: close() failed: %s", session.sid, failure)

    def _track(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def aclose(self) -> None:
        """Stop: requests computing answer 503; every open session's close() gets a short while."""
        await self.answers.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        sessions, self.sessions = list(self.sessions.values()), {}
        if sessions:
            closes = [asyncio.ensure_future(self._close_quietly(s)) for s in sessions]
            _, late = await asyncio.wait(closes, timeout=SHUTDOWN_CLOSE_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*closes, return_exceptions=True)


def step_answer(result: Any) -> dict:
    """A step's ``(observation, reward, done, info)`` (a list once it crossed from a worker) as fields."""
    if not (isinstance(result, list) and len(result) == 4):
        raise EpisodeFailure(
            "env_error", f"step() returned {type(result).__name__}, not (observation, reward, done, info)"
        )
    observation, reward, done, info = result
    return {"observation": observation, "reward": reward, "done": done, "info": info}


def check_op(msg: object, op: str) -> str | None:
    """Why ``msg`` is not a version-1 request for ``op``, or None."""
    return check_request(msg, SCHEMA, VERSION, _OPS[op], what=f"{op} request", optional=_OPTIONAL)


def _digest(op: str, sid: str, msg: dict) -> str:
    """What a request asks, less its id (an id is one request, whatever its path)."""
    return digest_of([op, sid, {k: v for k, v in msg.items() if k != "id"}])


# ----- the command ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    env: str
    host: str = "127.0.0.1"
    port: int = 0
    workers: int | None = None  # None: one per CPU
    threads: int = 32
    deadline_s: float = 20.0
    lease_s: float = 600.0
    memory_mb: int | None = None
    token_file: str | None = None


def serve(settings: Settings) -> int:
    """Serve until SIGINT (returns 130) or SIGTERM (143); prints its URL (never its token) once ready.
    Logs go where the caller set them up (the CLI: stderr)."""
    s = settings
    if (s.workers is not None and s.workers < 1) or s.threads < 1 or s.deadline_s <= 0 or s.lease_s <= 0:
        raise UserError("env-serve needs --workers >= 1, --threads >= 1, --deadline-s > 0 and --lease-s > 0")
    if not 0 <= s.port <= 65535 or (s.memory_mb is not None and s.memory_mb < 16):
        raise UserError("env-serve needs a --port in 0..65535 and --memory-mb >= 16")
    return serve_until_signal(functools.partial(_serve, s), s.token_file, TOKEN_ENV, "asyncrl-env-", log)


async def _serve(s: Settings, token: str, token_path: Path | None) -> None:
    """Serve until cancelled (by :func:`~asyncrl.service.http.until_signal`)."""
    workers = s.workers or os.cpu_count() or 1
    sizes = {"workers": workers, "threads": s.threads, "memory_mb": s.memory_mb}
    # each worker imports the class as it starts (within READY_TIMEOUT_S), never within an open's deadline
    pool = WorkerPool(**sizes, name=f"env-serve {s.env}", start_timeout_s=READY_TIMEOUT_S, preload=(s.env,))
    try:
        await _check_env(pool, s.env)
        service = EnvService(pool, s.env, token, deadline_s=s.deadline_s, lease_s=s.lease_s)
        async with listening(service.app(), s.host, s.port, log) as url:
            shape = f"{workers} workers x {s.threads} threads, deadline {s.deadline_s:g} s, lease {s.lease_s:g} s"
            announce("env-serve", s.env, url, shape, token_path, TOKEN_ENV, "episode.env_url")
            service._track(service.keep_leases())
            try:
                await asyncio.Future()  # forever: until a signal cancels this
            finally:
                await service.aclose()
    finally:
        await pool.aclose()


async def _check_env(pool: WorkerPool, env: str) -> None:
    """:class:`UserError` unless a worker can import ``env`` as an environment class."""
    try:
        await pool.call(f"{__name__}:describe_env", [env], {}, timeout_s=READY_TIMEOUT_S, kind="env")
    except EpisodeFailure as failure:
        raise UserError(f"cannot serve {env!r}: {failure.detail or failure.cause}") from None
