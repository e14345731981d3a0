"""Killable worker processes for a generator's plain (blocking) user code: environments, tools, rewards.

A hang, crash or memory blow-up in user code ends only the calls it touched, never the generator, and
processes and threads stay bounded whatever the code does:

* **Workers** are fresh interpreters (``python -c``), at most ``workers``, started as calls need them.
  Each runs calls on up to ``threads`` threads, and the parent never sends one more than ``threads``
  calls at once: a call never queues inside a worker, so its deadline is its own.
* **Faults** raise :class:`WorkerFault`, cause ``{kind}_{what}`` (``kind``: env, tool, reward).
  ``error``: the code raised (the worker stays; a user's own :class:`EpisodeFailure` keeps its cause).
  ``timeout``: no answer within ``timeout_s`` of the worker taking the call; a thread cannot be killed,
  so its worker is (SIGKILL, by pid), and a new one starts when next needed. ``crash``: the worker died
  by itself (the signal or exit code is named). ``memory``: its RSS passed ``memory_mb`` (polled every
  :data:`MEMORY_POLL_S`) and it was killed: every call and session there gets ``memory``. A crash has
  suspects: its stateless calls get ``crash``; each session's step in flight runs again on a worker
  of its own (one at a time, beyond ``workers``), a crash there its own. A timeout has a culprit; the
  others there are collateral: a stateless call (:meth:`WorkerPool.call`) runs again on another
  worker within its own timeout (building a session: once more), so plain tools and rewards may run
  twice when a neighbour's hang killed their worker; a session with a call in flight is ``lost``, one
  idle is rebuilt elsewhere at its next call by **replay** (:mod:`asyncrl.service.sessions`):
  its recorded calls made again, each checked to return what it did.
* **Queueing** for a free thread never counts against a call's timeout; callers are served first come,
  first served. A call failed by its worker's death returns once that worker is reaped.
* **Sessions** (:meth:`WorkerPool.open`) build one object in one worker and send it every method call.
  A new session goes to a new worker while fewer than ``workers`` run, else to the one holding fewest
  sessions: one crash ends few episodes.

The parent side is pure asyncio on the generator's one event loop (per worker a reader task and an
exit watch, per pool one memory poll): nothing here takes a lock.

Wire (version :data:`VERSION`): one JSON object per line (never pickle), at most :data:`MAX_LINE` bytes;
results must be JSON (a tuple arrives as a list; anything else is the call's ``error``).

* worker -> parent, first: ``{"ready": true, "version", "pid", "threads"}``
* parent -> worker: ``{"id", "op": "call", "target", "args", "kwargs"}`` | ``{"id", "op": "open",
  "session", "target", "kwargs"}`` | ``{"id", "op": "method", "session", "method", "args"}`` |
  ``{"id", "op": "close", "session"}``; a target is an import path ``"module:qualname"``.
* worker -> parent: ``{"id", "ok": value, "threads"}`` | ``{"id", "error": one line, "type": exception
  type, "cause"?: a user EpisodeFailure's cause, "threads"}``; ``threads``: the worker's live threads.

A worker moves its stdin and stdout aside before user code runs (prints go to stderr, the generator's;
``input()`` reads nothing), ignores SIGINT, dies with the generator (``PR_SET_PDEATHSIG``) and is the
kernel's first choice when memory runs out (``oom_score_adj`` 1000: a crash, not the generator). It loads
``pool_worker.py`` alone (its side of the wire), not the ``asyncrl.episodes`` package (whose episode
API imports numpy and more), and the parent's ``sys.path``: what the generator can import, it can; a
replacement starts in ~0.1 s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import os
import sys
from typing import Any

from asyncrl.errors import EpisodeFailure
from asyncrl.service.pool_worker import MAX_LINE, VERSION, WorkerFault, death, rss_bytes
from asyncrl.service.pool_worker import encode as _encode
from asyncrl.service.sessions import Session, Suspect, fail_sessions

log = logging.getLogger("asyncrl.service.pool")

START_TIMEOUT_S = 60.0  # a fresh interpreter is up in a second; this is for a machine under heavy load
MEMORY_POLL_S = 0.2  # RSS checks: a blow-up at GB/s overshoots the limit by a fraction of a second's growth
REAP_WAIT_S = 5.0  # a SIGKILLed process is gone in milliseconds unless stuck in the kernel (NFS)
_WORKER_CODE = (  # argv: pool_worker.py, the parent's sys.path, its pid, threads, what to preload
    "import importlib.util as u, json, sys; sys.path[:] = json.loads(sys.argv[2]); "
    "s = u.spec_from_file_location('_asyncrl_pool_worker', sys.argv[1]); m = u.module_from_spec(s); "
    "sys.modules[s.name] = m; s.loader.exec_module(m); "
    "sys.exit(m.worker_main(int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])))"
)


# ----- the parent side -------------------------------------------------------------------------


class _Collateral(Exception):
    """A stateless call whose worker was killed for another call's hang: it may run again."""


class _Unsent(Exception):
    """The worker a slot was reserved on died before the request was sent: place it again."""


class _Call:
    """One request a worker holds: its slot stays taken until it is answered or the worker dies,
    even if its caller was cancelled (a thread there still runs it)."""

    def __init__(self, future: asyncio.Future, kind: str, session: Session | None):
        self.future, self.kind, self.session = future, kind, session
        self.timer: asyncio.TimerHandle | None = None


class Worker:
    """One worker process as the parent sees it. ``load`` (reserved + sent) never exceeds ``threads``."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.proc: asyncio.subprocess.Process | None = None
        self.pid: int | None = None
        self.ready: asyncio.Future[str | None] = loop.create_future()  # None, or why it did not start
        self.exited: asyncio.Task | None = None  # the process reaped
        self.pending: dict[int, _Call] = {}
        self.reserved = 0  # slots taken by callers about to send
        self.sessions: set[Session] = set()
        self.waiters: collections.deque[asyncio.Future] = collections.deque()  # session calls for a slot here
        self.failure: tuple[str, str] | None = None  # (what, detail) once killed or dead

    @property
    def load(self) -> int:
        return self.reserved + len(self.pending)


class WorkerPool:
    """Up to ``workers`` worker processes of ``threads`` threads each (and one for a suspect), for one
    generator's event loop. ``memory_mb`` bounds each shared worker's RSS; ``name`` names the code.
    ``preload``: import paths a worker imports before it is ready, within ``start_timeout_s`` rather than
    a call's timeout (a heavy module: sympy, torch); one that fails there fails the call that needs it."""

    def __init__(self, *, workers: int = 4, threads: int = 32, memory_mb: int | None = None, name: str = "user code",
                 start_timeout_s: float = START_TIMEOUT_S, preload: tuple[str, ...] = ()):  # fmt: skip
        if workers < 1 or threads < 1 or (memory_mb is not None and memory_mb < 1):
            raise ValueError("a worker pool needs workers >= 1, threads >= 1 and memory_mb >= 1 (or None)")
        self.workers, self.threads, self.memory_mb, self.name = workers, threads, memory_mb, name
        self.start_timeout_s, self.preload = start_timeout_s, list(preload)
        self._workers: list[Worker] = []  # starting or running; a killed one leaves at once
        self._waiters: collections.deque[asyncio.Future] = collections.deque()  # stateless calls for a slot
        self._tasks: set[asyncio.Task] = set()  # spawns, readers, the memory poll
        self._exits: set[asyncio.Task] = set()
        self.ids = itertools.count(1)
        self.detached: set[Session] = set()  # sessions whose worker died, awaiting their replay
        self._lone: Worker | None = None  # a suspect's own, one at a time, beyond ``workers``
        self._lone_held = False
        self._lone_queue: collections.deque[asyncio.Future] = collections.deque()
        self._closed = False
        self._poll: asyncio.Task | None = None
        self.counters = dict.fromkeys(
            ("workers_started", "peak_workers", "peak_threads", "calls", "sessions_opened", "timeouts",
             "crashes", "memory_kills", "lost", "retried", "sessions_replayed", "replay_mismatch",
             "replay_failed", "suspects_cleared", "suspects_blamed"), 0)  # fmt: skip

    # -- the API -----------------------------------------------------------------------------------
    async def call(self, target: str, args: list, kwargs: dict, *, timeout_s: float, kind: str) -> Any:
        """``target(*args, **kwargs)`` on any worker with a free thread; run again whenever another call's
        hang killed that worker, within ``timeout_s`` of its first send (then ``timeout``: the call may
        have hung itself, its neighbour's deadline coming just before its own)."""
        self.counters["calls"] += 1
        message = {"op": "call", "target": target, "args": list(args), "kwargs": dict(kwargs)}
        loop, deadline, runs = asyncio.get_running_loop(), None, 0
        while True:
            try:
                worker = await self._call_slot(kind)
                deadline = deadline or loop.time() + timeout_s  # queueing for the first slot is free
                left = deadline - loop.time()
                if left <= 0:  # hung itself, or its workers kept being killed under it: no answer in time
                    worker.reserved -= 1
                    self._wake()
                    why = f"ran {runs} times, its worker killed each time for another call's hang"
                    raise WorkerFault(kind, "timeout", f"{target} gave no answer within {timeout_s:g} s ({why})")
                runs += 1
                return await self.ask(worker, message, left, kind, target)
            except _Unsent:
                continue
            except _Collateral as exc:
                self.counters["retried"] += 1
                log.info("%s: running %s again on another worker: %s", self.name, target, exc)

    async def open(self, target: str, kwargs: dict, *, timeout_s: float, kind: str = "env") -> Session:
        """A :class:`Session` of ``target(**kwargs)``, built inside one worker (again, once, elsewhere
        if another call's hang killed that worker meanwhile)."""
        retried = False
        while True:
            worker = await self.session_slot(kind)
            session = Session(self, worker, kind, target, kwargs)
            worker.sessions.add(session)  # from now on its worker's death fails it
            message = {"op": "open", "session": session.id, "target": target, "kwargs": dict(kwargs)}
            try:
                await self.ask(worker, message, timeout_s, kind, target, session)
            except WorkerFault as exc:
                worker.sessions.discard(session)
                if exc.what != "lost" or retried or self._closed:
                    raise
                retried = True
                self.counters["lost"] -= 1  # counted when its worker died; it is built again instead
                self.counters["retried"] += 1
                continue
            except BaseException:  # cancelled: an object built after this stays in its worker till it ends
                worker.sessions.discard(session)
                raise
            self.counters["sessions_opened"] += 1
            return session

    async def aclose(self) -> None:
        """Kill every worker (SIGKILL, by pid) and wait until each is reaped; calls and sessions still
        on them raise ``{kind}_lost``. Idempotent; the pool takes no calls afterwards."""
        self._closed = True
        for worker in [*self._workers, *([self._lone] if self._lone else [])]:
            self._kill(worker, "lost", f"the {self.name} pool was closed")
        _release(self._waiters, len(self._waiters))
        _release(self._lone_queue, len(self._lone_queue))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*self._exits, return_exceptions=True)

    def stats(self) -> dict[str, int]:
        """Counters since start; ``workers_alive`` and ``sessions_open`` (detached ones too) are now."""
        open_ = sum(len(w.sessions) for w in self._workers) + len(self.detached)
        return {**self.counters, "workers_alive": len(self._workers), "sessions_open": open_}

    # -- placing calls -------------------------------------------------------------------------------
    async def _call_slot(self, kind: str) -> Worker:
        """A started worker with a slot reserved for this call: the least loaded one with a free thread,
        else a new one while fewer than ``workers`` run, else the first slot to free up."""
        again = False
        while True:
            self._check_open(kind)
            if again or not self._waiters:  # behind calls already waiting
                free = [w for w in self._workers if w.load < self.threads]
                worker = min(free, key=lambda w: w.load) if free else None
                if worker is None and len(self._workers) < self.workers:
                    worker = self._start()
                if worker is not None:
                    worker.reserved += 1
                    return await self._started(worker, kind)
            await self._wait(self._waiters, again)
            again = True

    async def session_slot(self, kind: str) -> Worker:
        """A new worker while fewer than ``workers`` run, else the one holding fewest sessions; a slot
        on it reserved."""
        again = False
        while True:
            self._check_open(kind)
            if len(self._workers) < self.workers:
                worker = self._start()
            else:
                worker = min(self._workers, key=lambda w: (len(w.sessions), w.load))
            if worker.load < self.threads:
                worker.reserved += 1
                try:
                    return await self._started(worker, kind)
                except _Unsent:
                    continue
            await self._wait(worker.waiters, again)
            again = True

    async def session_call(self, session: Session, message: dict, timeout_s: float) -> Any:
        worker, label = session.worker, message.get("method", message["op"])
        again = False
        while session.failure is None and worker.load >= self.threads:
            await self._wait(worker.waiters, again)
            again = True
        if session.failure is not None:
            raise WorkerFault(session.kind, *session.failure)
        worker.reserved += 1
        return await self.ask(worker, message, timeout_s, session.kind, f"{session.target}.{label}", session)

    async def _wait(self, queue: collections.deque, again: bool) -> None:
        """Until :meth:`_wake` releases this caller (first in line again if it was released before)."""
        waiter = asyncio.get_running_loop().create_future()
        queue.appendleft(waiter) if again else queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._wake()  # released, then cancelled: the next one in line gets the slot
            with contextlib.suppress(ValueError):
                queue.remove(waiter)
            raise

    def _wake(self) -> None:
        """Release as many waiting callers as there may be free slots; each checks again."""
        for worker in self._workers:
            _release(worker.waiters, self.threads - worker.load)
        free = sum(self.threads - w.load for w in self._workers) + (self.workers - len(self._workers)) * self.threads
        _release(self._waiters, free)

    def _check_open(self, kind: str) -> None:
        if self._closed:
            raise WorkerFault(kind, "lost", f"the {self.name} pool is closed")

    # -- one request ---------------------------------------------------------------------------------
    async def ask(self, worker: Worker, message: dict, timeout_s: float, kind: str, label: str, session=None):
        """Send ``message`` in the slot reserved on ``worker``; its answer, or its fault. The deadline
        runs from the send, on a timer, so it fires even when the caller was cancelled meanwhile."""
        rid = next(self.ids)
        try:
            line = _encode({"id": rid, **message})
        except (TypeError, ValueError, RecursionError) as exc:
            worker.reserved -= 1
            self._wake()
            raise WorkerFault(kind, "error", f"the arguments of {label} cannot be sent: {exc}") from None
        loop = asyncio.get_running_loop()
        call = _Call(loop.create_future(), kind, session)
        worker.reserved -= 1
        worker.pending[rid] = call
        why = f"{label} gave no answer within {timeout_s:g} s"
        call.timer = loop.call_later(timeout_s, self._expire, worker, rid, why)
        with contextlib.suppress(ConnectionError):  # a dead worker: its reader reports how it died
            worker.proc.stdin.write(line)
            await worker.proc.stdin.drain()
        try:
            return await call.future
        except (WorkerFault, _Collateral, Suspect) as exc:
            if worker.failure is not None and worker.exited is not None:
                await asyncio.wait([worker.exited], timeout=REAP_WAIT_S)
            raise exc from None

    def _expire(self, worker: Worker, rid: int, why: str) -> None:
        if rid in worker.pending:
            self._kill(worker, "timeout", f"{why}; its worker (pid {worker.pid}) was killed", culprit=rid)

    def _answer(self, worker: Worker, msg: dict) -> None:
        call = worker.pending.pop(msg.get("id"), None)
        if call is None:
            return
        call.timer.cancel()
        self.counters["peak_threads"] = max(self.counters["peak_threads"], int(msg.get("threads", 0)))
        if not call.future.done():
            if "ok" in msg:
                call.future.set_result(msg["ok"])
            elif msg.get("cause"):
                call.future.set_exception(EpisodeFailure(str(msg["cause"]), str(msg.get("error", ""))))
            else:
                call.future.set_exception(WorkerFault(call.kind, "error", str(msg.get("error", ""))))
        self._wake()

    # -- a worker's life -----------------------------------------------------------------------------
    async def alone(self, kind: str) -> Worker:
        """A fresh worker for one suspect, a slot reserved on it, once this caller's turn comes (first
        come, first served; waiting is free); :meth:`alone_done` kills it and ends the turn."""
        loop = asyncio.get_running_loop()
        while self._lone_held:
            waiter = loop.create_future()
            self._lone_queue.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                with contextlib.suppress(ValueError):
                    self._lone_queue.remove(waiter)
                if waiter.done() and not waiter.cancelled():
                    _release(self._lone_queue, 1)  # released, then cancelled: the next one's turn
                raise
        self._check_open(kind)
        self._lone_held = True
        self._lone = self._start(shared=False)
        self._lone.reserved += 1
        try:
            return await self._started(self._lone, kind)
        except BaseException as exc:
            self.alone_done(None)
            if isinstance(exc, _Unsent):
                raise WorkerFault(kind, "crash", "a worker for a suspect alone died before its first call") from None
            raise

    def alone_done(self, session: Session | None) -> None:
        if self._lone is not None:
            self._lone.sessions.discard(session)
            self._kill(self._lone, "lost", f"a suspect of {self.name} ran alone on this worker")
        self._lone, self._lone_held = None, False
        _release(self._lone_queue, 1)

    def _start(self, shared: bool = True) -> Worker:
        worker = Worker(asyncio.get_running_loop())
        if shared:
            self._workers.append(worker)
        self.counters["workers_started"] += 1
        self.counters["peak_workers"] = max(self.counters["peak_workers"], len(self._workers))
        self._track(self._spawn(worker))
        if self.memory_mb is not None and self._poll is None:
            self._poll = self._track(self._poll_memory())
        return worker

    async def _started(self, worker: Worker, kind: str) -> Worker:
        """``worker`` once it is up, its reserved slot still held; ``{kind}_crash`` if it could not
        start, :class:`_Unsent` if it died since."""
        try:
            failed = await asyncio.shield(worker.ready)  # others wait for the same start
        except asyncio.CancelledError:
            worker.reserved -= 1
            self._wake()
            raise
        if worker.failure is None:
            return worker
        worker.reserved -= 1
        if failed is None:
            raise _Unsent
        raise WorkerFault(kind, worker.failure[0], f"a worker for {self.name} did not start: {failed}")

    async def _spawn(self, worker: Worker) -> None:
        path = json.dumps([os.path.abspath(p) for p in sys.path if isinstance(p, str)])  # the parent's imports
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pool_worker.py")
        argv = [sys.executable, "-c", _WORKER_CODE, here, path, str(os.getpid()), str(self.threads)]
        argv.append(json.dumps(self.preload))
        pipe = asyncio.subprocess.PIPE
        try:
            worker.proc = await asyncio.create_subprocess_exec(*argv, stdin=pipe, stdout=pipe, limit=MAX_LINE)
            worker.pid = worker.proc.pid
            worker.exited = asyncio.ensure_future(worker.proc.wait())
            self._exits.add(worker.exited)
            worker.exited.add_done_callback(self._exits.discard)
            line = await asyncio.wait_for(worker.proc.stdout.readline(), self.start_timeout_s)
            if not line:
                raise ValueError(death(worker.pid, await asyncio.shield(worker.exited)))
            hello = json.loads(line)
            if not (isinstance(hello, dict) and hello.get("ready") and hello.get("version") == VERSION):
                raise ValueError(f"not a version-{VERSION} worker: {line[:200]!r}")
        except (OSError, ValueError, TimeoutError) as exc:
            self._kill(worker, "crash", str(exc) or f"no ready line within {self.start_timeout_s:g} s")
            return
        worker.ready.set_result(None)
        self._track(self._read(worker))

    async def _read(self, worker: Worker) -> None:
        """Answers until the worker's stdout ends; then, unless it was killed, it crashed."""
        try:
            while line := await worker.proc.stdout.readline():
                msg = json.loads(line)
                if not isinstance(msg, dict):
                    raise ValueError(f"a message that is not an object: {line[:80]!r}")
                self._answer(worker, msg)
        except ValueError as exc:  # not JSON, or over MAX_LINE
            self._kill(worker, "crash", f"worker (pid {worker.pid}) broke the protocol: {exc}")
            return
        if worker.failure is None:
            with contextlib.suppress(ValueError):
                self._workers.remove(worker)  # no new calls while its exit status arrives
            code = await asyncio.shield(worker.exited)
            self._kill(worker, "crash", death(worker.pid, code))

    def _kill(self, worker: Worker, what: str, detail: str, culprit: int | None = None) -> None:
        """End ``worker`` (SIGKILL, by pid) and fail what it held: the culprit's call (when known) and,
        for a crash or memory kill, everything with ``what``; after a timeout, a stateless neighbour
        as :class:`_Collateral` and a neighbouring session as ``lost`` (or replayed, idle)."""
        if worker.failure is not None:
            return
        worker.failure = (what, detail)
        if not worker.ready.done():  # killed while starting: those waiting for it learn why
            worker.ready.set_result(detail)
        with contextlib.suppress(ValueError):
            self._workers.remove(worker)
        if worker.proc is not None and worker.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                worker.proc.kill()
        counter = {"timeout": "timeouts", "crash": "crashes", "memory": "memory_kills"}.get(what)
        if counter is not None:
            self.counters[counter] += 1
            log.warning("%s: %s", self.name, detail)
        guilty = worker.pending.get(culprit)
        hung = "session's step" if guilty is not None and guilty.session is not None else "call"
        suspects = fail_sessions(worker, what, detail, guilty.session if guilty is not None else None, hung)
        for call in worker.pending.values():
            call.timer.cancel()
            if call.future.done():
                continue
            if call.session in suspects:
                call.future.set_exception(Suspect(detail))
            elif call is guilty or what != "timeout":
                call.future.set_exception(WorkerFault(call.kind, what, detail))
            elif call.session is not None:
                call.future.set_exception(WorkerFault(call.kind, *call.session.failure))
            else:
                call.future.set_exception(_Collateral(f"its worker was killed after another {hung} hung: {detail}"))
        worker.pending.clear()
        _release(worker.waiters, len(worker.waiters))
        self._wake()

    async def _poll_memory(self) -> None:
        page, limit = os.sysconf("SC_PAGE_SIZE"), self.memory_mb * 2**20
        while True:
            await asyncio.sleep(MEMORY_POLL_S)
            for worker in list(self._workers):
                rss = rss_bytes(worker.pid, page) if worker.pid is not None else 0
                if rss > limit:
                    detail = f"worker (pid {worker.pid}) held {rss >> 20} MB, past the {self.memory_mb} MB limit"
                    self._kill(worker, "memory", detail + "; it was killed")

    def _track(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _release(queue: collections.deque, n: int) -> None:
    """Wake the first ``n`` callers still waiting in ``queue``."""
    while n > 0 and queue:
        waiter = queue.popleft()
        if not waiter.done():
            waiter.set_result(None)
            n -= 1


__all__ = ["MAX_LINE", "VERSION", "Session", "WorkerFault", "WorkerPool"]
