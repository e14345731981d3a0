"""``asyncrl reward-serve``: any reward function over HTTP, from a pool of killable worker processes.

    asyncrl reward-serve --reward asyncrl.rewards.math_answer:math_reward --workers 8 --deadline-s 10

The wire protocol (``asyncrl.reward`` version 1) is documented in :mod:`asyncrl.rewards.remote`.

* **A hard deadline per item.** A worker is one process computing one item at a time. An item with
  no answer ``deadline_s`` after its worker took it is answered ``error`` (cause ``reward_timeout``);
  the worker is killed (SIGKILL, by pid) and a fresh one started in its place, so a hung reward costs
  one worker for one deadline, never the server. A worker that dies mid-item answers
  ``reward_error`` and is replaced the same way. Queueing for a free worker does not count against
  the deadline: keep ``deadline_s`` well under the clients' ``episode.reward_timeout_s``.
* **Idempotent by request id.** Answers (``error`` answers too) of the last :data:`CACHE_SIZE` ids
  are kept; a repeated id is answered from there without calling the reward again, and one that
  arrives while the first still computes waits for that same computation, which is not tied to its
  HTTP request: a client that disconnects still leaves the answer for its retry.
* **No pickle across processes.** Workers are plain subprocesses (``python -c``, a fresh interpreter)
  reading one JSON object per line on stdin and writing one per line on stdout; only JSON crosses.
  (``multiprocessing`` pipes and queues pickle, and forking a process that runs an event loop is
  unsafe.) A worker's stdout is moved to stderr before the reward is imported, so its prints cannot
  corrupt the channel. Workers get SIGKILL when the server dies (``PR_SET_PDEATHSIG``) and ignore
  SIGINT: Ctrl-C stops the server, which stops its workers.
* **Loopback and a token by default.** The server binds 127.0.0.1 unless told otherwise and needs
  ``Authorization: Bearer <token>`` on every request. The token is read from ``--token-file`` (made,
  0600, when missing), else ``$ASYNCRL_REWARD_TOKEN``, else generated into a temporary 0600 file
  removed at exit. Only the file's path is ever printed or logged.
* **Strict about requests.** A body must arrive within a read deadline (:func:`read_deadline_s`:
  seconds, more for a large body), else it is answered 408 and its connection closed, so a client
  that promised more bytes than it sends holds no connection. A body nested deeper than
  :data:`MAX_DEPTH` (a 100k-level ``[[[...`` included, which the JSON parser cannot even read) and a
  request with a field the protocol does not name are answered 400, naming the depth or the fields:
  the client (``asyncrl.rewards.remote``) sends exactly the protocol's fields, so an unknown one is a
  client of another protocol or version, whose request would be misread if its extra were dropped.
* **Signals.** SIGINT (Ctrl-C) and SIGTERM stop the server at any point, start-up included, even
  when it was started with SIGINT ignored (a background job of a non-interactive shell): it exits
  130 on SIGINT and 143 on SIGTERM (128 + the signal, as a shell reports a process the signal
  killed), after answering 503 to what was still computing and stopping its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import inspect
import json
import logging
import os
import secrets
import signal
import sys
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

from asyncrl.data import import_by_path
from asyncrl.errors import EpisodeFailure, UserError
from asyncrl.rewards.remote import SCHEMA, TOKEN_ENV, VERSION
from asyncrl.rewards.resolve import one_line, reward_parts

log = logging.getLogger("asyncrl.rewards.serve")

CACHE_SIZE = 10_000  # answers kept by id: far more than any client's retries can span
MAX_PENDING = 4096  # items queued or computing; past this a request is answered 429 (back-pressure)
MAX_BODY = 32 * 2**20  # one request's bytes: a long prompt, completion and record fit many times over
READY_TIMEOUT_S = 120.0  # a worker's start-up: a heavy reward module (sympy, torch) can take this long
# A request's body arrives within READ_DEADLINE_S plus its size at READ_MIN_RATE: a client sends it at
# once, and even the largest (MAX_BODY) takes seconds at this rate; a stalled sender is cut off.
READ_DEADLINE_S = 5.0
READ_MIN_RATE = 2**20  # bytes per second
# After an answer given before its body was read (408, 401, 413), the rest is drained this long before
# the connection closes: aiohttp's default (10 s) would let a stalled sender hold it on.
LINGER_S = 1.0
# Nesting of a request's JSON: dataset records are a few levels deep; this stays far below the recursion
# limit (1000) under which the JSON codec parses the request here and again in a worker.
MAX_DEPTH = 64
FIELDS = ("schema", "version", "id", "prompt", "completion", "record")  # a version-1 request, no more
_LINE_LIMIT = MAX_BODY + 2**20  # longest line read from a worker
_WORKER_CODE = "import sys; from asyncrl.rewards.serve import worker_main; sys.exit(worker_main(sys.argv[1]))"


# ----- worker process side -------------------------------------------------------------------


def worker_main(spec: str) -> int:
    """A worker's loop: import ``spec``, then answer one JSON line per JSON line until stdin closes.

    The server writes ``{"id", "prompt", "completion", "record"}``; the worker answers first
    ``{"ready": true}`` (``{"fatal": str}`` if the reward cannot be imported), then per item
    ``{"id", "reward": x}``, ``{"id", "parts": {...}}`` or ``{"id", "error": str, "cause": str}``.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops its workers itself
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the reward's own prints (Python or C) go to stderr, never into the channel
    sys.stdout = sys.stderr

    def send(message: dict) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    try:
        fn = import_by_path(spec)
    except UserError as exc:
        send({"fatal": str(exc)})
        return 2
    send({"ready": True})
    for line in sys.stdin.buffer:
        item = json.loads(line)
        send({"id": item["id"], **_answer(fn, item)})
    return 0


def _answer(fn, item: dict) -> dict:
    """``fn`` on one item, judged like :func:`asyncrl.rewards.resolve.score` judges a local reward."""
    try:
        value = fn(item["prompt"], item["completion"], item["record"])
        if inspect.iscoroutine(value):
            value = asyncio.run(value)
        parts = reward_parts(value)
    except EpisodeFailure as exc:
        return {"error": exc.detail or exc.cause, "cause": exc.cause}
    except Exception as exc:  # noqa: BLE001 - the user's reward: any error is an answer
        return {"error": one_line(exc), "cause": "reward_error"}
    return {"parts": parts} if isinstance(value, Mapping) else {"reward": parts["reward"]}


# ----- the pool ------------------------------------------------------------------------------


class _WorkerDied(Exception):
    pass


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc, self.pid = proc, proc.pid

    async def read(self) -> dict:
        line = await self.proc.stdout.readline()
        if not line:
            code = await self.proc.wait()
            raise _WorkerDied(f"worker (pid {self.pid}) exited with code {code}")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise _WorkerDied(f"worker (pid {self.pid}) wrote a line that is not JSON") from None

    async def ask(self, line: bytes) -> dict:
        try:
            self.proc.stdin.write(line)
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise _WorkerDied(f"worker (pid {self.pid}) is gone") from None
        return await self.read()

    async def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()  # SIGKILL this pid
        await self.proc.wait()


class WorkerPool:
    """``size`` worker processes serving ``spec``; :meth:`run` computes one item under the deadline."""

    def __init__(self, spec: str, size: int, deadline_s: float):
        self.spec, self.size, self.deadline_s = spec, size, deadline_s
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    async def start(self) -> None:
        """Start every worker; :class:`UserError` if one cannot import the reward."""
        workers = await asyncio.gather(*(self._spawn() for _ in range(self.size)), return_exceptions=True)
        failed = [w for w in workers if isinstance(w, BaseException)]
        if failed:
            await self.close()
            raise failed[0]
        for worker in workers:
            self._idle.put_nowait(worker)

    async def run(self, item: dict) -> dict:
        """The worker's answer to ``item`` (``reward``/``parts``/``error``); never raises for the reward."""
        line = (json.dumps(item) + "\n").encode()
        worker = await self._idle.get()
        try:
            answer = await asyncio.wait_for(worker.ask(line), self.deadline_s)
        except TimeoutError:
            why = f"no answer within the {self.deadline_s:g} s deadline"
            self._retire(worker, why)
            return {"error": f"{why} (worker killed)", "cause": "reward_timeout"}
        except _WorkerDied as exc:
            self._retire(worker, str(exc))
            return {"error": f"{exc} while computing the reward", "cause": "reward_error"}
        except BaseException:  # cancelled (shutdown): the worker may be mid-item
            self._retire(worker, "cancelled")
            raise
        self._idle.put_nowait(worker)
        answer.pop("id", None)
        return answer

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.kill() for w in list(self._all)), return_exceptions=True)
        self._all.clear()

    async def _spawn(self) -> _Worker:
        from asyncrl.lifetime import die_with

        pipe, argv = asyncio.subprocess.PIPE, [sys.executable, "-c", _WORKER_CODE, self.spec]
        kill_with_me = die_with(os.getpid(), signal.SIGKILL)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=pipe, stdout=pipe, limit=_LINE_LIMIT, preexec_fn=kill_with_me
        )
        worker = _Worker(proc)
        self._all.add(worker)
        try:
            hello = await asyncio.wait_for(worker.read(), READY_TIMEOUT_S)
            if "fatal" in hello:
                raise UserError(str(hello["fatal"]))
        except BaseException as exc:
            await self._discard(worker)
            if isinstance(exc, TimeoutError | _WorkerDied):
                why = str(exc) or f"no ready line within {READY_TIMEOUT_S:g} s"
                raise UserError(f"a reward-serve worker for {self.spec!r} did not start: {why}") from None
            raise
        return worker

    async def _discard(self, worker: _Worker) -> None:
        self._all.discard(worker)
        await worker.kill()

    def _retire(self, worker: _Worker, why: str) -> None:
        """Kill ``worker`` and start its replacement in the background."""
        log.warning("worker (pid %d): %s; replacing it", worker.pid, why)
        task = asyncio.ensure_future(self._replace(worker))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _replace(self, worker: _Worker) -> None:
        await self._discard(worker)
        while not self._closed:
            try:
                self._idle.put_nowait(await self._spawn())
                return
            except (UserError, OSError) as exc:  # the module broke on disk since start-up, no processes left, ...
                log.error("cannot start a worker: %s; retrying in 5 s", exc)
                await asyncio.sleep(5.0)


# ----- HTTP ----------------------------------------------------------------------------------


class Service:
    """``POST /score``: the protocol, behind the token, answered from the cache or the pool."""

    def __init__(self, pool: WorkerPool, token: str):
        self.pool = pool
        self._expected = f"Bearer {token}".encode()
        self.cache: OrderedDict[str, tuple[str, asyncio.Future]] = OrderedDict()  # id -> (digest, answer)
        self.computing: set[asyncio.Future] = set()

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/score", self.score)
        return app

    async def score(self, request):
        if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), self._expected):
            return _fail(401, "missing or wrong bearer token")
        try:
            body = await asyncio.wait_for(request.read(), read_deadline_s(request.content_length))
        except TimeoutError:
            response = _fail(408, "the request's body did not arrive in time")
            response.force_close()  # the rest of the body may still come: never read it as a request
            return response
        try:
            msg = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return _fail(400, f"the body is not JSON: {exc}")
        except RecursionError:
            return _fail(400, f"the body is nested more than {MAX_DEPTH} levels deep")
        problem = check_request(msg)
        if problem:
            return _fail(400, problem)
        rid = msg["id"]
        item = {"id": rid, "prompt": msg["prompt"], "completion": msg["completion"], "record": msg["record"]}
        digest = hashlib.sha256(json.dumps([msg["prompt"], msg["completion"], msg["record"]]).encode()).hexdigest()
        if rid in self.cache:
            seen, task = self.cache[rid]
            if seen != digest:
                return _fail(409, f"id {rid!r} was already used for a different request")
        elif len(self.computing) >= MAX_PENDING:
            return _fail(429, f"{len(self.computing)} requests pending; retry later")
        else:
            task = self._compute(item, digest)
        try:
            answer = await asyncio.shield(task)  # the computation outlives this request
        except asyncio.CancelledError:
            if task.cancelled():
                return _fail(503, "the server is shutting down")
            raise
        return _reply({"schema": SCHEMA, "version": VERSION, "id": rid, **answer})

    def _compute(self, item: dict, digest: str) -> asyncio.Future:
        """Start computing ``item`` apart from its request; cache the answer under its id."""
        task = asyncio.ensure_future(self.pool.run(item))
        self.computing.add(task)
        self.cache[item["id"]] = (digest, task)
        while len(self.cache) > CACHE_SIZE:
            self.cache.popitem(last=False)

        def done(t: asyncio.Future) -> None:
            self.computing.discard(t)
            if (t.cancelled() or t.exception() is not None) and self.cache.get(item["id"], (0, 0))[1] is t:
                del self.cache[item["id"]]  # no answer to keep: a retry computes anew

        task.add_done_callback(done)
        return task


def _reply(body: dict, status: int = 200):
    from aiohttp import web

    return web.json_response(body, status=status)


def _fail(status: int, error: str):
    return _reply({"error": error}, status)


def read_deadline_s(content_length: int | None) -> float:
    """How long a request's body may take to arrive (see :data:`READ_DEADLINE_S`)."""
    return READ_DEADLINE_S + min(content_length or 0, MAX_BODY) / READ_MIN_RATE


def json_depth(value: object) -> int:
    """Nesting depth of parsed JSON (a scalar is 0, ``[]`` is 1), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def check_request(msg: object) -> str | None:
    """Why ``msg`` is not a version-1 request, or None."""
    if not isinstance(msg, dict):
        return "the body must be a JSON object"
    if msg.get("schema") != SCHEMA or msg.get("version") != VERSION:
        return f"this server speaks {SCHEMA!r} version {VERSION}, not {msg.get('schema')!r} {msg.get('version')!r}"
    unknown = sorted(set(msg) - set(FIELDS))
    if unknown:
        names = ", ".join(map(repr, unknown))
        return f"unknown field(s) {names}: a version-{VERSION} request has only {', '.join(FIELDS)}"
    if json_depth(msg) > MAX_DEPTH:
        return f"the body is nested more than {MAX_DEPTH} levels deep"
    rid = msg.get("id")
    if not isinstance(rid, str) or not 1 <= len(rid) <= 128:
        return "'id' must be a string of 1-128 characters"
    for field, kind in (("prompt", str), ("completion", str), ("record", dict)):
        if not isinstance(msg.get(field), kind):
            return f"{field!r} must be a {'string' if kind is str else 'JSON object'}"
    return None


# ----- token and the command -----------------------------------------------------------------


def load_token(token_file: str | None) -> tuple[str, Path | None, bool]:
    """``(token, the file holding it or None, whether that file is a temporary one to remove)``."""
    import tempfile

    if token_file:
        path = Path(token_file)
        if path.exists():
            token = path.read_text().strip()
            if not token:
                raise UserError(f"the token file {path} is empty")
            if path.stat().st_mode & 0o077:
                log.warning("the token file %s is readable by others: chmod 600 it", path)
            return token, path, False
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        temporary = False
    elif os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip(), None, False
    else:
        fd, name = tempfile.mkstemp(prefix="asyncrl-reward-", suffix=".token")  # mode 0600
        path, temporary = Path(name), True
    token = secrets.token_urlsafe(32)  # URL-safe: fits a URL's userinfo as is
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path, temporary


def serve(reward: str, *, host="127.0.0.1", port=0, workers=None, deadline_s=20.0, token_file=None) -> int:
    """Serve ``reward`` until SIGINT (returns 130) or SIGTERM (143); prints its URL (never its token)
    once it is ready."""
    from asyncrl.observe.metrics import setup_logging

    workers = workers if workers is not None else (os.cpu_count() or 1)
    if workers < 1 or deadline_s <= 0 or not 0 <= port <= 65535:
        raise UserError("reward-serve needs --workers >= 1, --deadline-s > 0 and a --port in 0..65535")
    setup_logging(name="reward-serve")
    token, path, temporary = load_token(token_file)
    try:
        return asyncio.run(until_signal(_serve(reward, host, port, workers, deadline_s, token, path)))
    finally:
        if temporary and path is not None:
            path.unlink(missing_ok=True)


async def until_signal(work) -> int:
    """Run the coroutine ``work`` until SIGINT or SIGTERM, then cancel it (its cleanup runs) and return
    128 + the signal; 0 if ``work`` ends first. The handlers are this loop's, installed
    before ``work`` starts and whatever SIGINT disposition the process inherited (a background job's
    is "ignore"); a second signal while ``work`` cleans up changes nothing."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    received: list[int] = []

    def on_signal(sig: int) -> None:
        if not received:
            received.append(sig)
            task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await task
        return 0
    except asyncio.CancelledError:
        if not received:
            raise
        return 128 + received[0]
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _serve(reward, host, port, workers, deadline_s, token, token_path) -> None:
    """Serve until cancelled (by :func:`until_signal`)."""
    from aiohttp import web

    pool = WorkerPool(reward, workers, deadline_s)
    try:
        await pool.start()
        service = Service(pool, token)
        runner = web.AppRunner(service.app(), access_log=None, lingering_time=LINGER_S)
        await runner.setup()
        try:
            try:
                await web.TCPSite(runner, host, port, shutdown_timeout=5.0).start()
            except OSError as exc:
                raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
            bound = runner.addresses[0][1]
            url = f"http://{f'[{host}]' if ':' in host else host}:{bound}/score"
            if host not in ("127.0.0.1", "localhost", "::1"):
                log.warning("listening on %s: requests and token travel unencrypted; keep to a trusted network", host)
            where = f"token in {token_path}" if token_path else f"token from ${TOKEN_ENV}"
            print(f"asyncrl reward-serve: {reward} at {url} ({workers} workers, deadline {deadline_s:g} s)", flush=True)
            print(f"asyncrl reward-serve: {where}; clients: data.reward: http://:TOKEN@{url[7:]}", flush=True)
            await asyncio.Future()  # forever: until a signal cancels this
        finally:
            for task in list(service.computing):  # their requests answer 503; no handler waits on a hung item
                task.cancel()
            await runner.cleanup()
    finally:
        await pool.close()
