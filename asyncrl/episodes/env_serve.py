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
    ``asyncrl.episodes.pool_sessions``). After any cause but env_error the session is gone.
    400 not JSON, nested over 64 levels, another schema or version, an unknown, missing or mistyped field
    401 no or wrong token    404 no such session: closed, idle past its lease, or the server restarted
    408 the body did not arrive in time (5 s + its size at 1 MiB/s)    409 the id was seen with another
    request    413 body over 32 MiB    429 overloaded: retry later    503 shutting down
    (a non-200 body is {"error": str}, or plain text from the HTTP layer)

* **Idempotent by request id.** The answers of the last :data:`CACHE_SIZE` ids (faults included) are
  kept; a repeated id with the same request is answered from there without stepping again, also while
  the first still computes (it awaits that same computation, which is not tied to its HTTP request).
  The same id with another request (or session) is 409.
* **Leases.** Every request to a session renews its lease; a session idle for ``--lease-s`` (no
  request, none computing) is closed, its environment's ``close()`` called and its worker slot freed,
  so the sessions of a generator that died do not leak. A live episode pauses between steps only for
  its model turn: keep the lease well above that.
* **User code never runs in this process.** Every session is built and driven in a
  :class:`~asyncrl.episodes.pool.WorkerPool` (``--workers`` processes, ``--threads`` calls each), plain
  and ``async`` classes alike (a session's coroutines run on its own loop in its worker): a hang is
  killed at ``--deadline-s``, and a crash ends only the sessions of its worker. A session's calls run
  one at a time, in arrival order. Keep ``--deadline-s`` under the clients' ``episode.step_timeout_s``.
* **As** ``asyncrl reward-serve`` (:mod:`asyncrl.rewards.serve`): loopback and a token by default (from
  ``--token-file``, made 0600 when missing, else ``$ASYNCRL_ENV_TOKEN``, else a temporary 0600 file
  removed at exit; only the file's path is printed), the read deadline, the nesting limit, exit code 2
  for a class that cannot be imported, and SIGINT / SIGTERM exiting 130 / 143, after the open sessions
  were closed and the workers killed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
from collections import OrderedDict
from pathlib import Path
from typing import Any

from asyncrl.episodes.pool import WorkerPool
from asyncrl.episodes.remote_env import CAUSES, ENDED, SCHEMA, TOKEN_ENV, VERSION
from asyncrl.errors import EpisodeFailure, UserError
from asyncrl.rewards import serve as reward_serve
from asyncrl.rewards.serve import LINGER_S, MAX_BODY, MAX_DEPTH, json_depth, read_deadline_s, until_signal

log = logging.getLogger("asyncrl.episodes.env_serve")

CACHE_SIZE = 10_000  # answers kept by id: far more than any client's retries can span
MAX_PENDING = 4096  # requests computing; past this a request is answered 429 (back-pressure)
MAX_SESSIONS = 100_000  # open sessions; past this opening one is answered 429
READY_TIMEOUT_S = 120.0  # the first worker's start and import of the class: a heavy module can take this long
SHUTDOWN_CLOSE_S = 5.0  # at a signal, the sessions' close() calls together get this long, then workers are killed
_OPS = {  # a request's fields (besides schema, version, id) and their JSON types, by operation
    "open": {"options": dict},
    "reset": {"task": dict, "seed": int},
    "step": {"action": str},
    "close": {},
}
_OPTIONAL = {"options"}
_KINDS = {dict: "a JSON object", int: "an integer", str: "a string"}


class _Refused(Exception):
    """A request answered with an HTTP error status instead of being computed."""

    def __init__(self, status: int, error: str):
        super().__init__(error)
        self.status = status

    def response(self):
        response = _reply({"error": str(self)}, self.status)
        if self.status == 408:
            response.force_close()  # the rest of the body may still come: never read it as a request
        return response


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


class Service:
    """The protocol over a :class:`WorkerPool`: sessions, their leases, the answer cache."""

    def __init__(self, pool: WorkerPool, env: str, token: str, *, deadline_s: float, lease_s: float):
        self.pool, self.env, self.deadline_s, self.lease_s = pool, env, deadline_s, lease_s
        self._expected = f"Bearer {token}".encode()
        self.sessions: dict[str, _Session] = {}
        self.cache: OrderedDict[str, tuple[str, asyncio.Future]] = OrderedDict()  # id -> (digest, answer)
        self.computing: set[asyncio.Future] = set()
        names = ("opened", "closed", "expired", "ended", "resets", "steps", "repeats")  # repeats: answered from cache
        self.counts = collections.Counter(dict.fromkeys(names, 0))
        self.faults: collections.Counter[str] = collections.Counter()
        self._tasks: set[asyncio.Task] = set()  # background closes and the lease keeper
        self.stopping = False

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_get("/health", self.health)
        app.router.add_post("/sessions", self.open)
        app.router.add_post("/sessions/{sid}/{op}", self.session_op)
        return app

    # ----- handlers ----------------------------------------------------------------------------------

    async def health(self, request):
        if not self._authorized(request):
            return _Refused(401, "missing or wrong bearer token").response()
        counts = {"sessions": len(self.sessions), "computing": len(self.computing), **self.counts}
        head = {"schema": SCHEMA, "version": VERSION, "env": self.env}
        return _reply({**head, **counts, "faults": dict(self.faults), "pool": self.pool.stats()})

    async def open(self, request):
        try:
            msg = await self._message(request, "open")

            def start():
                if len(self.sessions) >= MAX_SESSIONS:
                    raise _Refused(429, f"{len(self.sessions)} sessions open; retry later")
                return self._open(msg.get("options", {}))

            return await self._answer(msg["id"], _digest("open", "", msg), start)
        except _Refused as refused:
            return refused.response()

    async def session_op(self, request):
        sid, op = request.match_info["sid"], request.match_info["op"]
        try:
            if not self._authorized(request):
                raise _Refused(401, "missing or wrong bearer token")
            if op not in ("reset", "step", "close"):
                raise _Refused(404, f"no operation {op!r}: a session has reset, step and close")
            msg = await self._message(request, op)
            session = self.sessions.get(sid)
            if session is not None:
                session.last = asyncio.get_running_loop().time()  # every request renews the lease

            def start():
                if session is None or self.sessions.get(sid) is not session:
                    raise _Refused(
                        404, f"no session {sid[:64]!r}: closed, idle past its lease, or the server restarted"
                    )
                session.busy += 1
                if op == "close":
                    del self.sessions[sid]
                    self.counts["closed"] += 1
                return self._run(session, op, msg)

            return await self._answer(msg["id"], _digest(op, sid, msg), start)
        except _Refused as refused:
            return refused.response()

    # ----- the protocol's plumbing -------------------------------------------------------------------

    def _authorized(self, request) -> bool:
        return hmac.compare_digest(request.headers.get("Authorization", "").encode(), self._expected)

    async def _message(self, request, op: str) -> dict:
        """The request's checked body; :class:`_Refused` (401, 408, 400) when it is not one."""
        if not self._authorized(request):
            raise _Refused(401, "missing or wrong bearer token")
        try:
            body = await asyncio.wait_for(request.read(), read_deadline_s(request.content_length))
        except TimeoutError:
            raise _Refused(408, "the request's body did not arrive in time") from None
        try:
            msg = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _Refused(400, f"the body is not JSON: {exc}") from None
        except RecursionError:
            raise _Refused(400, f"the body is nested more than {MAX_DEPTH} levels deep") from None
        problem = check_request(msg, op)
        if problem:
            raise _Refused(400, problem)
        return msg

    async def _answer(self, rid: str, digest: str, start):
        """The answer to request ``rid``: the cached one, else ``start()``'s (a coroutine, computed apart
        from this request, or :class:`_Refused` before anything runs)."""
        if self.stopping:
            raise _Refused(503, "the server is shutting down")
        if rid in self.cache:
            seen, task = self.cache[rid]
            if seen != digest:
                raise _Refused(409, f"id {rid!r} was already used for a different request")
            self.cache.move_to_end(rid)
            self.counts["repeats"] += 1
        elif len(self.computing) >= MAX_PENDING:
            raise _Refused(429, f"{len(self.computing)} requests computing; retry later")
        else:
            task = self._compute(rid, digest, start())
        try:
            answer = await asyncio.shield(task)  # the computation outlives this request
        except asyncio.CancelledError:
            if task.cancelled():
                raise _Refused(503, "the server is shutting down") from None
            raise
        return _reply({"schema": SCHEMA, "version": VERSION, "id": rid, **answer})

    def _compute(self, rid: str, digest: str, work) -> asyncio.Future:
        task = asyncio.ensure_future(work)
        self.computing.add(task)
        self.cache[rid] = (digest, task)
        while len(self.cache) > CACHE_SIZE:
            self.cache.popitem(last=False)

        def done(t: asyncio.Future) -> None:
            self.computing.discard(t)
            if (t.cancelled() or t.exception() is not None) and self.cache.get(rid, (0, 0))[1] is t:
                del self.cache[rid]  # no answer to keep: a retry computes anew

        task.add_done_callback(done)
        return task

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
        self.stopping = True
        for task in [*self.computing, *self._tasks]:
            task.cancel()
        await asyncio.gather(*self.computing, *self._tasks, return_exceptions=True)
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


def check_request(msg: object, op: str) -> str | None:
    """Why ``msg`` is not a version-1 request for ``op``, or None."""
    if not isinstance(msg, dict):
        return "the body must be a JSON object"
    if msg.get("schema") != SCHEMA or msg.get("version") != VERSION:
        return f"this server speaks {SCHEMA!r} version {VERSION}, not {msg.get('schema')!r} {msg.get('version')!r}"
    fields = {"schema": str, "version": int, "id": str, **_OPS[op]}
    unknown = sorted(set(msg) - set(fields))
    if unknown:
        names = ", ".join(map(repr, unknown))
        return f"unknown field(s) {names}: a version-{VERSION} {op} request has only {', '.join(fields)}"
    if json_depth(msg) > MAX_DEPTH:
        return f"the body is nested more than {MAX_DEPTH} levels deep"
    rid = msg.get("id")
    if not isinstance(rid, str) or not 1 <= len(rid) <= 128:
        return "'id' must be a string of 1-128 characters"
    for field, kind in _OPS[op].items():
        if field not in msg and field in _OPTIONAL:
            continue
        value = msg.get(field)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{field!r} must be {_KINDS[kind]}"
    return None


def _digest(op: str, sid: str, msg: dict) -> str:
    """What a request asks, less its id: a retry must match it exactly."""
    asked = {k: v for k, v in msg.items() if k != "id"}
    return hashlib.sha256(json.dumps([op, sid, asked], sort_keys=True).encode()).hexdigest()


def _reply(body: dict, status: int = 200):
    from aiohttp import web

    return web.json_response(body, status=status)


# ----- token and the command -----------------------------------------------------------------------


def load_token(token_file: str | None) -> tuple[str, Path | None, bool]:
    """``(token, the file holding it or None, whether that file is a temporary one to remove)``:
    ``--token-file`` as reward-serve reads it, else ``$ASYNCRL_ENV_TOKEN``, else a new temporary file."""
    import tempfile

    if token_file:
        return reward_serve.load_token(token_file)
    if os.environ.get(TOKEN_ENV, "").strip():
        return os.environ[TOKEN_ENV].strip(), None, False
    fd, name = tempfile.mkstemp(prefix="asyncrl-env-", suffix=".token")  # mode 0600
    token = secrets.token_urlsafe(32)  # URL-safe: fits a URL's userinfo as is
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, Path(name), True


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
    token, path, temporary = load_token(s.token_file)
    try:
        return asyncio.run(until_signal(_serve(s, token, path)))
    finally:
        if temporary and path is not None:
            path.unlink(missing_ok=True)


async def _serve(s: Settings, token: str, token_path: Path | None) -> None:
    """Serve until cancelled (by :func:`until_signal`)."""
    from aiohttp import web

    workers = s.workers or os.cpu_count() or 1
    pool = WorkerPool(workers=workers, threads=s.threads, memory_mb=s.memory_mb, name=f"env-serve {s.env}")
    try:
        await _check_env(pool, s.env)
        service = Service(pool, s.env, token, deadline_s=s.deadline_s, lease_s=s.lease_s)
        runner = web.AppRunner(service.app(), access_log=None, lingering_time=LINGER_S)
        await runner.setup()
        try:
            try:
                await web.TCPSite(runner, s.host, s.port, shutdown_timeout=5.0).start()
            except OSError as exc:
                raise UserError(f"cannot listen on {s.host}:{s.port}: {exc.strerror or exc}") from None
            host = f"[{s.host}]" if ":" in s.host else s.host
            url = f"http://{host}:{runner.addresses[0][1]}"
            if s.host not in ("127.0.0.1", "localhost", "::1"):
                log.warning("listening on %s: requests and token travel unencrypted; keep to a trusted network", s.host)
            where = f"token in {token_path}" if token_path else f"token from ${TOKEN_ENV}"
            shape = f"{workers} workers x {s.threads} threads, deadline {s.deadline_s:g} s, lease {s.lease_s:g} s"
            print(f"asyncrl env-serve: {s.env} at {url} ({shape})", flush=True)
            print(f"asyncrl env-serve: {where}; clients: episode.env_url: http://:TOKEN@{url[7:]}", flush=True)
            service._track(service.keep_leases())
            try:
                await asyncio.Future()  # forever: until a signal cancels this
            finally:
                await service.aclose()
        finally:
            await runner.cleanup()
    finally:
        await pool.aclose()


async def _check_env(pool: WorkerPool, env: str) -> None:
    """:class:`UserError` unless a worker can import ``env`` as an environment class."""
    try:
        await pool.call(f"{__name__}:describe_env", [env], {}, timeout_s=READY_TIMEOUT_S, kind="env")
    except EpisodeFailure as failure:
        raise UserError(f"cannot serve {env!r}: {failure.detail or failure.cause}") from None
