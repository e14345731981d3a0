"""The worker side of :mod:`asyncrl.service.pool`: one fresh interpreter running plain user code.

A worker loads this file alone (by path, not through the ``asyncrl.episodes`` package, whose episode
API imports numpy and more), so a replacement is up in ~0.1 s; the wire is described in the pool's
docstring. Requests run on a thread each, at most ``threads`` at once (the parent never sends more).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import os
import signal
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncrl.errors import EpisodeFailure

VERSION = 1
MAX_LINE = 64 * 2**20  # one message: a long observation or a big tool result fits many times over


class WorkerFault(EpisodeFailure):
    """A call the pool could not complete; ``cause`` is ``{kind}_{what}``, ``what`` one of error,
    timeout, crash, memory, lost."""

    def __init__(self, kind: str, what: str, detail: str):
        super().__init__(f"{kind}_{what}", detail)
        self.kind, self.what = kind, what


def worker_main(parent_pid: int, threads: int, preload: list[str] | tuple[str, ...] = ()) -> int:
    """A worker's loop: import ``preload``, then read requests from stdin, run each on a thread, answer on
    stdout; exit when stdin closes (without waiting for threads that may never return)."""
    from asyncrl.lifetime import die_with

    die_with(parent_pid, signal.SIGKILL)()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the generator stops its workers itself
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")  # out of memory faster than the poll sees, the kernel kills a worker, not the generator
    requests, channel = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # user code reading stdin gets nothing, never a request
    os.close(null)
    os.dup2(2, 1)  # user prints (Python or C) go to stderr, never into the channel
    sys.stdout = sys.stderr
    lock = threading.Lock()

    def send(line: bytes) -> None:
        with lock:
            channel.write(line)
            channel.flush()

    for target in preload:  # a failure here is left to the call that needs the target: it reports it
        with contextlib.suppress(_TargetError):
            _resolve(target)
    sessions: dict[int, _Held] = {}
    send(encode({"ready": True, "version": VERSION, "pid": os.getpid(), "threads": threads}))
    executor = ThreadPoolExecutor(threads, thread_name_prefix="user-code")
    for line in requests:
        executor.submit(_serve, sessions, json.loads(line), send)
    os._exit(0)


class _Held:
    """A session's object in a worker. Its calls run one at a time (``lock``): an object need not be
    thread-safe, and its coroutines all run on its one event loop (``runner``), so a connection opened
    in ``reset`` still works in ``step``."""

    def __init__(self) -> None:
        self.obj: Any = None
        self.lock = threading.Lock()
        self.runner: asyncio.Runner | None = None


def _settle(value: Any, held: _Held | None = None) -> Any:
    """A result; a coroutine (``async def`` code) run to its end, on the session's loop or a fresh one."""
    if not inspect.iscoroutine(value):
        return value
    if held is None:
        return asyncio.run(value)
    held.runner = held.runner or asyncio.Runner()
    return held.runner.run(value)


class _TargetError(Exception):
    """A target that does not name something importable (no user code ran)."""


def _serve(sessions: dict[int, _Held], msg: dict, send) -> None:
    """Run one request on this thread and send its answer, whatever happens."""
    try:
        answer = {"id": msg["id"], "ok": _run(sessions, msg)}
    except BaseException as exc:  # noqa: BLE001 - the user's code: any error (SystemExit too) is an answer
        answer = {"id": msg["id"], **_error_of(exc)}
    answer["threads"] = threading.active_count()
    try:
        line = encode(answer)
    except (TypeError, ValueError, RecursionError) as exc:
        error = f"{type(exc).__name__}: the result cannot be sent: {exc}"
        line = encode({"id": msg["id"], "error": error, "type": type(exc).__name__, "threads": answer["threads"]})
    send(line)


def _run(sessions: dict[int, _Held], msg: dict) -> Any:
    op = msg["op"]
    if op == "call":
        return _settle(_resolve(msg["target"])(*msg["args"], **msg["kwargs"]))
    if op == "open":
        held = _Held()
        held.obj = _settle(_resolve(msg["target"])(**msg["kwargs"]), held)
        sessions[msg["session"]] = held
        return None
    held = sessions.get(msg["session"])
    if held is None:
        raise LookupError(f"no session {msg['session']} in this worker")
    with held.lock:
        if op == "method":
            return _settle(getattr(held.obj, msg["method"])(*msg["args"]), held)
        try:  # close
            close = getattr(held.obj, "close", None)
            return _settle(close(), held) if callable(close) else None
        finally:
            sessions.pop(msg["session"], None)
            if held.runner is not None:
                held.runner.close()


def _resolve(target: str) -> Any:
    module_name, sep, qualname = target.partition(":")
    if not (sep and module_name and qualname):
        raise _TargetError(f"{target!r} is not of the form 'module:qualname'")
    try:
        found = importlib.import_module(module_name)
    except BaseException as exc:  # noqa: BLE001 - any error at import time is the user's module's
        raise _TargetError(f"cannot import {target!r}: {_one_line(exc)}") from None
    for part in qualname.split("."):
        try:
            found = getattr(found, part)
        except AttributeError as exc:
            raise _TargetError(f"cannot import {target!r}: {exc}") from None
    tools = sys.modules.get("asyncrl.episodes.tools")
    if tools is not None and isinstance(found, tools.Tool):
        found = found.fn  # a @tool: the function it declares (asyncrl.episodes.user_code.target_of names it so)
    return found


def _error_of(exc: BaseException) -> dict:
    if isinstance(exc, EpisodeFailure):
        return {"error": exc.detail or exc.cause, "type": type(exc).__name__, "cause": exc.cause}
    if isinstance(exc, _TargetError):
        return {"error": str(exc), "type": "ImportError"}
    return {"error": _one_line(exc), "type": type(exc).__name__}


def _one_line(exc: BaseException) -> str:
    """As :func:`asyncrl.rewards.resolve.one_line`, which a worker does not import (it is heavy)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def encode(msg: dict) -> bytes:
    line = json.dumps(msg).encode() + b"\n"
    if len(line) > MAX_LINE:
        raise ValueError(f"{len(line)} bytes of JSON, over the {MAX_LINE >> 20} MiB a message may hold")
    return line


# ----- facts about a worker process, read by the parent ----------------------------------------


def rss_bytes(pid: int, page: int) -> int:
    """The resident memory of process ``pid`` (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * page
    except (OSError, IndexError, ValueError):  # gone, or not Linux
        return 0


def death(pid: int | None, code: int | None) -> str:
    """How worker ``pid`` ended, from its exit status (negative: the signal that killed it)."""
    if code is not None and code < 0:
        try:
            return f"worker (pid {pid}) died of {signal.Signals(-code).name}"
        except ValueError:
            return f"worker (pid {pid}) died of signal {-code}"
    return f"worker (pid {pid}) exited with code {code}"
