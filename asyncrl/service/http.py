"""JSON over HTTP, written once: the pieces ``asyncrl reward-serve`` and ``asyncrl env-serve`` are built
from, and the limits the OpenAI-compatible endpoint reads its requests under.

* **Limits.** A body over :data:`MAX_BODY` is 413 (aiohttp's answer). One that does not arrive within
  :func:`read_deadline_s` (seconds, more for a large body) is 408 and its connection is closed, so a
  client that promised more bytes than it sends holds no connection. One nested deeper than
  :data:`MAX_DEPTH` (a 100k-level ``[[[...`` included, which the JSON parser cannot even read) is 400.
* **A token.** Every request carries ``Authorization: Bearer <token>``, compared in constant time
  (:class:`Door`). :func:`load_token` reads it from a file (made 0600 when missing), else an environment
  variable, else generates it into a temporary 0600 file removed at exit; only the file's path is printed.
* **Versioned requests** (:func:`check_request`): the schema and version, no field the protocol does not
  name (a client of another protocol or version, whose request would be misread if its extra were
  dropped), an ``id`` of 1-128 characters, each field of its JSON type. A refusal (:class:`Refused`) is
  a status and ``{"error": str}``; an answer is ``{"schema", "version", "id", ...}``.
* **Idempotent by request id** (:class:`Answers`): the answers (faults too) of the last :data:`CACHE_SIZE`
  ids are kept; a repeated id with the same request is answered from there without computing again, also
  while the first still computes (it awaits that same computation, which is not tied to its HTTP request:
  a client that disconnects still leaves the answer for its retry). The same id with another request is
  409; past :data:`MAX_PENDING` computations a new request is 429 (back-pressure); once stopping, 503.
* **Signals** (:func:`until_signal`): SIGINT and SIGTERM stop a server at any point, start-up included,
  even when it was started with SIGINT ignored (a background job of a non-interactive shell); it exits
  128 + the signal (130, 143), as a shell reports a process the signal killed.

Everything runs on the server's one event loop; nothing here takes a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import signal
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.errors import UserError

if TYPE_CHECKING:
    import logging

CACHE_SIZE = 10_000  # answers kept by id: far more than any client's retries can span
MAX_PENDING = 4096  # requests computing; past this a request is answered 429 (back-pressure)
MAX_BODY = 32 * 2**20  # one request's bytes: a long prompt, completion and record fit many times over
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
LOOPBACK = ("127.0.0.1", "localhost", "::1")
_KINDS = {dict: "a JSON object", int: "an integer", str: "a string"}


class Refused(Exception):
    """A request answered with an HTTP error status and ``{"error": str}`` instead of being computed."""

    def __init__(self, status: int, error: str):
        super().__init__(error)
        self.status = status

    def response(self):
        response = reply({"error": str(self)}, self.status)
        if self.status == 408:
            response.force_close()  # the rest of the body may still come: never read it as a request
        return response


def reply(body: dict, status: int = 200):
    from aiohttp import web

    return web.json_response(body, status=status)


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


def check_request(
    msg: object, schema: str, version: int, fields: Mapping[str, type], what: str = "request", optional=()
) -> str | None:
    """Why ``msg`` is not a ``schema`` ``version`` request (``what`` names it) with ``fields`` (name ->
    JSON type) besides schema, version and id, those in ``optional`` maybe missing; or None."""
    if not isinstance(msg, dict):
        return "the body must be a JSON object"
    if msg.get("schema") != schema or msg.get("version") != version:
        return f"this server speaks {schema!r} version {version}, not {msg.get('schema')!r} {msg.get('version')!r}"
    named = ("schema", "version", "id", *fields)
    unknown = sorted(set(msg) - set(named))
    if unknown:
        names = ", ".join(map(repr, unknown))
        return f"unknown field(s) {names}: a version-{version} {what} has only {', '.join(named)}"
    if json_depth(msg) > MAX_DEPTH:
        return f"the body is nested more than {MAX_DEPTH} levels deep"
    rid = msg.get("id")
    if not isinstance(rid, str) or not 1 <= len(rid) <= 128:
        return "'id' must be a string of 1-128 characters"
    for field, kind in fields.items():
        if field not in msg and field in optional:
            continue
        value = msg.get(field)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{field!r} must be {_KINDS[kind]}"
    return None


def digest_of(asked: object) -> str:
    """What a request asks (its JSON, less its id): a retry under the same id must match it exactly."""
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()


class Door:
    """What a request passes before anything is computed: the token, then its body (read under the
    deadline, parsed, checked)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def authorized(self, request) -> bool:
        return hmac.compare_digest(request.headers.get("Authorization", "").encode(), self._expected)

    async def message(self, request, check: Callable[[object], str | None]) -> dict:
        """The request's body, ``check``-ed; :class:`Refused` (401, 408, 400) when it is not one."""
        if not self.authorized(request):
            raise Refused(401, "missing or wrong bearer token")
        try:
            body = await asyncio.wait_for(request.read(), read_deadline_s(request.content_length))
        except TimeoutError:
            raise Refused(408, "the request's body did not arrive in time") from None
        try:
            msg = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise Refused(400, f"the body is not JSON: {exc}") from None
        except RecursionError:
            raise Refused(400, f"the body is nested more than {MAX_DEPTH} levels deep") from None
        problem = check(msg)
        if problem:
            raise Refused(400, problem)
        return msg


class Answers:
    """The answer cache by request id, and what is computing (``waiting``: how a 429 calls it)."""

    def __init__(self, schema: str, version: int, waiting: str = "computing"):
        self.schema, self.version, self.waiting = schema, version, waiting
        self.cache: OrderedDict[str, tuple[str, asyncio.Future]] = OrderedDict()  # id -> (digest, answer)
        self.computing: set[asyncio.Future] = set()
        self.repeats = 0  # requests answered from the cache
        self.stopping = False

    async def answer(self, rid: str, digest: str, start: Callable[[], Awaitable[dict]]):
        """The reply to request ``rid``: the cached answer, else ``start()``'s (a coroutine, computed apart
        from this request, or :class:`Refused` before anything runs)."""
        if self.stopping:
            raise Refused(503, "the server is shutting down")
        if rid in self.cache:
            seen, task = self.cache[rid]
            if seen != digest:
                raise Refused(409, f"id {rid!r} was already used for a different request")
            self.cache.move_to_end(rid)
            self.repeats += 1
        elif len(self.computing) >= MAX_PENDING:
            raise Refused(429, f"{len(self.computing)} requests {self.waiting}; retry later")
        else:
            task = self._compute(rid, digest, start())
        try:
            answer = await asyncio.shield(task)  # the computation outlives this request
        except asyncio.CancelledError:
            if task.cancelled():
                raise Refused(503, "the server is shutting down") from None
            raise
        return reply({"schema": self.schema, "version": self.version, "id": rid, **answer})

    def _compute(self, rid: str, digest: str, work: Awaitable[dict]) -> asyncio.Future:
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

    async def stop(self) -> None:
        """Take no more requests (503); those computing are cancelled and answer 503, no handler waiting
        on a hung computation."""
        self.stopping = True
        computing = list(self.computing)
        for task in computing:
            task.cancel()
        await asyncio.gather(*computing, return_exceptions=True)


# ----- the token, the socket, the signals ------------------------------------------------------------


def load_token(
    token_file: str | None, token_env: str, prefix: str, log: logging.Logger
) -> tuple[str, Path | None, bool]:
    """``(token, the file holding it or None, whether that file is a temporary one to remove)``: from
    ``token_file`` (made when missing), else ``$token_env``, else a new temporary file named ``prefix...``."""
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
    elif os.environ.get(token_env, "").strip():
        return os.environ[token_env].strip(), None, False
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".token")  # mode 0600
        path, temporary = Path(name), True
    token = secrets.token_urlsafe(32)  # URL-safe: fits a URL's userinfo as is
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path, temporary


def serve_until_signal(main, token_file: str | None, token_env: str, prefix: str, log: logging.Logger) -> int:
    """``main(token, token_path)`` (a coroutine function) until SIGINT (returns 130) or SIGTERM (143), its
    token from :func:`load_token`; a temporary token file is removed at the end."""
    token, path, temporary = load_token(token_file, token_env, prefix, log)
    try:
        return asyncio.run(until_signal(main(token, path)))
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


@contextlib.asynccontextmanager
async def listening(app, host: str, port: int, log: logging.Logger) -> AsyncIterator[str]:
    """``app`` (an aiohttp application) served on ``host:port`` while the block runs; yields its URL,
    ``http://host:port``. Connections still open at the end get a few seconds to finish."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None, lingering_time=LINGER_S)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port, shutdown_timeout=5.0).start()
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        if host not in LOOPBACK:
            log.warning("listening on %s: requests and token travel unencrypted; keep to a trusted network", host)
        yield f"http://{f'[{host}]' if ':' in host else host}:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def announce(command: str, served: str, url: str, shape: str, token_path: Path | None, token_env: str, key: str):
    """The two lines a server prints once ready: what it serves where, and how clients name it (``key``:
    their setting), never its token."""
    where = f"token in {token_path}" if token_path else f"token from ${token_env}"
    print(f"asyncrl {command}: {served} at {url} ({shape})", flush=True)
    print(f"asyncrl {command}: {where}; clients: {key}: http://:TOKEN@{url[7:]}", flush=True)


def new_app():
    """An aiohttp application whose requests may carry up to :data:`MAX_BODY` bytes (413 past that)."""
    from aiohttp import web

    return web.Application(client_max_size=MAX_BODY)
