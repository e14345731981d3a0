"""Sessions of :class:`~asyncrl.service.pool.WorkerPool`: one object in one worker, and its replay
onto another worker when that one dies for a reason that was not (or may not be) the session's.

A session records the calls that built its object's state: its open (target and keyword arguments)
and each method call answered, in order (the method, its arguments as JSON, a digest of its JSON
result). When its worker dies while the session has no call in flight there (a crash, or a kill for
another call's hang: the session is innocent), the session is **detached** rather than lost; its next
call first rebuilds the object on another worker (a replacement while fewer than ``workers`` run) by
sending the recorded open and calls again, in order, each result checked against the one recorded:

* all match: the call goes on, the episode unaware (counted ``sessions_replayed``);
* one differs, the object not being a function of its calls (it reads the clock, an unseeded random
  generator, the process id, outside state): ``{kind}_lost`` (counted ``replay_mismatch``);
* a replayed call fails (raises, hangs, its new worker dies): ``{kind}_lost`` (counted ``replay_failed``);
* the record was dropped (past :data:`REPLAY_CALLS` calls or :data:`REPLAY_BYTES` bytes of arguments,
  or after a call that raised or was cancelled, leaving the object's state unknown): no replay, the
  session is ``{kind}_lost`` when its worker dies.

Invariants:

* The replay and the call it precedes (or, for a suspect, the step it runs again) share that call's
  ``timeout_s``, counted from its new worker's first free slot (starting it and queueing are free).
* Replayed calls run their side effects again (a file appended, a request sent): an environment that
  must not be replayed makes some result differ, or raises.
* A crash with steps of sessions in flight is one of theirs, which one unknown: each such session is a
  **suspect**. Its step fails with :class:`Suspect` inside the pool; the session is rebuilt from its
  record on a fresh worker of its own (the pool runs one at a time, beyond its ``workers``, each
  suspect waiting its turn for free) and the step runs again there: a crash (or hang, or memory kill)
  there is its own, the cause its episode gets (``suspects_blamed``); an answer is the step's, and the
  session is cleared (``suspects_cleared``) and replayed on a shared worker at its next call. A
  session is a suspect at most :data:`SUSPICIONS` times; then, or with no record, it gets ``crash``.
  A timeout's neighbours in flight are ``lost``; a memory kill replays no one (an idle object may
  hold the memory).
* Calls to one session come one at a time, as an episode makes them (a second while it is replayed is
  an ``error``); everything runs on the pool's event loop, without locks.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import TYPE_CHECKING, Any

from asyncrl.errors import EpisodeFailure
from asyncrl.service.pool_worker import WorkerFault

if TYPE_CHECKING:
    from asyncrl.service.pool import Worker, WorkerPool

# Bounds on what a session keeps for its replay. An episode makes tens of calls (turns); 64 covers
# multi-turn environments while bounding a replay to seconds of the call's timeout. 1 MiB of arguments
# (tasks, actions) per session holds hundreds of turns of text, and a generator's few hundred sessions
# in flight then keep at most a few hundred MB (results are kept as 16-byte digests, whatever their size).
REPLAY_CALLS = 64
REPLAY_BYTES = 2**20


SUSPICIONS = 3  # lone re-runs per session: an innocent step in flight at a few crashes still goes on


class Suspect(Exception):
    """A session's step in flight when its worker crashed: it runs again alone, to tell if it was the cause."""


class _Unreplayable(Exception):
    """A replayed call returned something else (``counter``: replay_mismatch) or failed (replay_failed)."""

    def __init__(self, detail: str, counter: str):
        super().__init__(detail)
        self.counter = counter


def digest(result: Any) -> bytes:
    """A result's identity: its JSON text, hashed (so 1 and 1.0 differ, and NaN equals NaN)."""
    return hashlib.blake2b(json.dumps(result).encode(), digest_size=16).digest()


class History:
    """The calls that built a session's object, to build it again elsewhere."""

    def __init__(self, kwargs: dict):
        self.kwargs = json.dumps(kwargs)
        self.calls: list[tuple[str, str, bytes]] = []  # (method, args as JSON, digest of the result)
        self.size = len(self.kwargs)

    def add(self, method: str, args: list, result: Any) -> bool:
        """Record an answered call; False once the record passes its bounds (then drop it)."""
        text = json.dumps(args)
        self.size += len(text)
        self.calls.append((method, text, digest(result)))
        return len(self.calls) <= REPLAY_CALLS and self.size <= REPLAY_BYTES


class Session:
    """An object built by :meth:`WorkerPool.open`, living in one worker (``worker``; None while
    detached, awaiting its replay). Once it has failed, every call raises the fault that ended it."""

    def __init__(self, pool: WorkerPool, worker: Worker, kind: str, target: str, kwargs: dict):
        self.pool, self.worker, self.kind, self.target = pool, worker, kind, target
        self.id = next(pool.ids)
        self.failure: tuple[str, str] | None = None
        self.closed = False
        self.dropped = "its options are not JSON"  # why ``history`` is None
        try:
            self.history: History | None = History(kwargs)  # None: not replayable
        except (TypeError, ValueError, RecursionError):  # its open fails as an error
            self.history = None
        self.detached: str | None = None  # why its worker died, while it awaits its replay
        self.replaying = False
        self.calling: History | None = None  # its history, set aside while a step is in flight
        self.on_probation = False  # its step runs again alone
        self.suspicions = 0

    async def call(self, method: str, args: list, *, timeout_s: float) -> Any:
        """``getattr(obj, method)(*args)`` in the session's worker (rebuilt there first if detached)."""
        if self.closed or self.replaying:
            why = "a closed session" if self.closed else "a session being replayed (one call at a time)"
            raise WorkerFault(self.kind, "error", f"{method} on {why} of {self.target}")
        if self.detached is not None:
            timeout_s = await self._replay(timeout_s)
        message = {"op": "method", "session": self.id, "method": method, "args": list(args)}
        history, self.history = self.history, None  # not replayable with a call in flight...
        if history is not None:  # ...nor after one that raises or is cancelled
            self.dropped = f"its {method} call raised or was cancelled, leaving its state unknown"
        self.calling = history
        try:
            result = await self.pool.session_call(self, message, timeout_s)
        except Suspect as exc:
            self.calling = None
            return await self.alone(method, list(args), history, timeout_s, str(exc))
        finally:
            self.calling = None
        self._record(history, method, args, result)
        return result

    async def close(self, *, timeout_s: float) -> None:
        """``obj.close()`` if it has one, then forget the object; raises only for the close itself
        (``error``, ``timeout``), never because the worker is already gone (or the object with it)."""
        if self.closed:
            return
        self.closed = True
        self.pool.detached.discard(self)
        try:
            if self.failure is None and self.detached is None:
                await self.pool.session_call(self, {"op": "close", "session": self.id}, timeout_s)
        except WorkerFault as exc:
            if exc.what in ("error", "timeout"):  # its close() raised or hung; else the worker was gone
                raise
        finally:
            if self.worker is not None:
                self.worker.sessions.discard(self)

    def detach(self, why: str) -> str | None:
        """Its worker died, for ``why``, with this session idle: None if it awaits its replay now, else
        the detail of its ``lost``."""
        if self.history is None:
            return f"{why} (not replayed: {self.dropped})"
        if self.replaying or self.closed:
            return why
        self.detached, self.worker = why, None
        self.pool.detached.add(self)
        return None

    def suspect(self) -> bool:
        """Its worker crashed with a step of this session in flight: True if that step is to run again
        alone (it can be rebuilt, is not running alone already, and was not suspected too often)."""
        if self.calling is None or self.on_probation or self.suspicions >= SUSPICIONS:
            return False
        self.suspicions += 1
        self.worker = None
        return True

    def _record(self, history: History | None, method: str, args: list, result: Any) -> None:
        if history is not None and history.add(method, args, result):
            self.history = history
        elif history is not None:
            self.dropped = f"its record passed {REPLAY_CALLS} calls or {REPLAY_BYTES >> 20} MiB of arguments"

    async def _rebuild(self, worker: Worker, history: History, timeout_s: float) -> float:
        """Build the object again on ``worker`` (a slot reserved there) from ``history``; what is left
        of ``timeout_s``. A result that differs or a replayed call that raises is :class:`_Unreplayable`;
        a fault of the worker is raised as it is."""
        pool, loop = self.pool, asyncio.get_running_loop()
        self.worker = worker
        worker.sessions.add(self)  # from now on its new worker's death fails it
        deadline = loop.time() + timeout_s
        opening = {"op": "open", "session": self.id, "target": self.target, "kwargs": json.loads(history.kwargs)}
        try:
            await pool.ask(worker, opening, timeout_s, self.kind, f"{self.target} (replayed)", self)
            for n, (method, args, recorded) in enumerate(history.calls, 1):
                message = {"op": "method", "session": self.id, "method": method, "args": json.loads(args)}
                left = deadline - loop.time()
                if left <= 0:
                    raise _Unreplayable(f"no time left of {timeout_s:g} s for its call {n}", "replay_failed")
                if digest(await pool.session_call(self, message, left)) != recorded:
                    said = f"its call {n} of {len(history.calls)} ({method}) returned something else"
                    raise _Unreplayable(said, "replay_mismatch")
        except EpisodeFailure as exc:
            if isinstance(exc, WorkerFault) and exc.what != "error":
                raise
            raise _Unreplayable(exc.detail or exc.cause, "replay_failed") from None
        return deadline - loop.time()

    async def _replay(self, timeout_s: float) -> float:
        """Rebuild the object on a shared worker from its history; what is left of ``timeout_s``."""
        pool, history, why = self.pool, self.history, self.detached
        pool.detached.discard(self)
        self.replaying, self.detached = True, None
        try:
            while True:
                try:
                    left = await self._rebuild(await pool.session_slot(self.kind), history, timeout_s)
                    break
                except WorkerFault:
                    if not self._rebuild_again():
                        raise
        except (_Unreplayable, EpisodeFailure) as exc:
            pool.counters[exc.counter if isinstance(exc, _Unreplayable) else "replay_failed"] += 1
            if self.failure is None or self.failure[0] != "lost":  # else counted when its new worker died
                pool.counters["lost"] += 1
            if self.worker is not None and self.failure is None:  # drop what was rebuilt
                await self._discard(timeout_s)
            self.failure = ("lost", f"{why}; replaying its calls on another worker failed: {_detail(exc)}")
            raise WorkerFault(self.kind, *self.failure) from None
        except BaseException:  # cancelled: what was rebuilt stays in its worker till that ends
            self.failure = ("lost", f"{why}; its replay was cancelled")
            raise
        finally:
            self.replaying = False
        self.history = history
        pool.counters["sessions_replayed"] += 1
        return left

    def _rebuild_again(self) -> bool:
        """Its new worker crashed under its replay, most likely for a neighbour (its calls answered
        before): True to replay it on another, at most :data:`SUSPICIONS` times."""
        worker = self.worker
        if worker is None or worker.failure is None or worker.failure[0] != "crash":
            return False
        if self.suspicions >= SUSPICIONS:
            return False
        self.suspicions += 1
        if self.failure is not None and self.failure[0] == "lost":
            self.pool.counters["lost"] -= 1  # counted when its new worker died; it is replayed again instead
        worker.sessions.discard(self)
        self.worker, self.failure = None, None
        return True

    async def alone(self, method: str, args: list, history: History, timeout_s: float, crash: str) -> Any:
        """Rebuild a suspect on a fresh worker of its own (after the suspects before it: waiting is
        free) and run its ``method`` call there again: a fault there is its own; an answer clears it
        (the object is replayed on a shared worker at its next call)."""
        pool, worker = self.pool, None
        why = f"its worker crashed with its {method} call in flight ({crash})"
        self.on_probation = True
        try:
            worker = await pool.alone(self.kind)
            left = await self._rebuild(worker, history, timeout_s)
            message = {"op": "method", "session": self.id, "method": method, "args": args}
            result = await pool.session_call(self, message, left)
        except _Unreplayable as exc:
            pool.counters[exc.counter] += 1
            pool.counters["lost"] += 1
            self.failure = ("lost", f"{why}; replaying its calls on a worker of its own failed: {exc}")
            raise WorkerFault(self.kind, *self.failure) from None
        except WorkerFault as exc:
            if exc.what in ("crash", "memory", "timeout") and worker is not None and worker.failure is not None:
                pool.counters["suspects_blamed"] += 1
                self.failure = (exc.what, f"{why}; run again on a worker of its own: {exc.detail}")
                raise WorkerFault(self.kind, *self.failure) from None
            self.failure = (exc.what, exc.detail)
            raise
        except BaseException:  # the call's own EpisodeFailure, or cancelled
            self.failure = ("lost", f"{why}; run again on a worker of its own, it did not answer")
            raise
        finally:
            self.on_probation = False
            if worker is not None:  # its turn: end it
                pool.alone_done(self)
        pool.counters["suspects_cleared"] += 1
        self._record(history, method, args, result)
        if self.detach(why) is not None:  # no record left to replay
            self.failure = ("lost", f"{why} (not replayed: {self.dropped})")
            pool.counters["lost"] += 1
        return result

    async def _discard(self, timeout_s: float) -> None:
        """Close a half-rebuilt object (it may not exist), whatever its close does."""
        try:
            await self.pool.session_call(self, {"op": "close", "session": self.id}, timeout_s)
        except EpisodeFailure:
            pass


def fail_sessions(worker: Worker, what: str, detail: str, guilty: Session | None, hung: str) -> set[Session]:
    """Fail the sessions of ``worker``, dead of ``what``, but the suspects it returns: those with a step
    in flight when it crashed (one of them its cause), each to run that step again alone (else they
    get ``what``, as the culprit does). An innocent one (a timeout's neighbour, or idle when it
    crashed) is detached for a replay if it is idle and can have one, else ``lost``."""
    busy, suspects = {call.session for call in worker.pending.values()}, set()
    for session in worker.sessions:
        if session.failure is not None:  # failed already (its replay here did not match)
            continue
        if what == "crash" and session in busy and session.suspect():
            suspects.add(session)
            continue
        if what == "timeout" and session is not guilty:
            why = f"its worker was killed after another {hung} hung: {detail}"
        elif what == "crash" and session not in busy:
            why = f"its worker died during another session's call: {detail}"
        else:
            session.failure = (what, detail)
            continue
        if session not in busy:
            why = session.detach(why)
            if why is None:  # rebuilt elsewhere at its next call
                continue
        session.failure = ("lost", why)
        session.pool.counters["lost"] += 1
    return suspects


def _detail(exc: BaseException) -> str:
    return exc.detail if isinstance(exc, EpisodeFailure) else str(exc)


__all__ = ["REPLAY_BYTES", "REPLAY_CALLS", "SUSPICIONS", "History", "Session", "Suspect", "digest", "fail_sessions"]
