"""Where user code runs: the one place that decides, for every environment, tool and reward call.

* ``async`` code runs on the generator's event loop. It is the default because it cannot block the
  loop (it yields at every ``await``), a timeout cancels it cleanly (no thread or process is left
  holding it), and it costs nothing per call: the guess demo's environments and remote rewards are
  ``async`` for this reason. Its one risk is native code crashing the process; write such code plain.
* Plain (blocking) code runs in the generator's :class:`~asyncrl.service.pool.WorkerPool` under
  ``episode.plain_code: process`` (the default): killable worker processes, a hard deadline per call,
  a crash or memory blow-up ending only the episodes whose calls or sessions that worker held
  (``env_timeout``, ``env_crash``, ``env_memory``, ``env_lost``; ``tool_*`` and ``reward_*`` alike). The
  code must be importable by path in a fresh interpreter (a module-level function or class); what is
  not (a lambda, a closure, something defined in ``__main__``) runs on a thread, as under
  ``episode.plain_code: thread``, where a call that never returns keeps its thread past its timeout.
  Rewards asked in one turn of the event loop share one call (:class:`RewardBatch`, ``episode.batch_rewards``).

An environment class runs as one **session** per episode: its instance is built inside one worker and
every ``reset``/``step``/``close`` of that episode goes to it (it is stateful).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from asyncrl.data import call_bounded, is_async
from asyncrl.rewards.batch import EACH
from asyncrl.service.pool import WorkerPool

if TYPE_CHECKING:
    from asyncrl.episodes.api import Context

Caller = Callable[..., Awaitable[Any]]  # (fn, timeout_s, *args, **kwargs) -> fn's result, like call_bounded


def caller(pool: WorkerPool | None, kind: str, batched: bool = False) -> Caller:
    """A :func:`~asyncrl.data.call_bounded`-shaped caller that runs plain, importable code in ``pool``
    (its faults raised as :class:`EpisodeFailure` ``{kind}_timeout`` / ``_crash`` / ``_memory`` /
    ``_error``), and everything else as ``call_bounded`` does (``TimeoutError``, or the code's own error).
    ``batched``: calls made in one turn of the event loop share one round trip (:class:`RewardBatch`)."""
    batch = RewardBatch.of(pool, kind) if batched and pool is not None else None

    async def call(fn: Callable, timeout_s: float, *args: Any, **kwargs: Any) -> Any:
        target = None if pool is None or is_async(fn) else target_of(fn)
        if target is None:
            return await call_bounded(fn, timeout_s, *args, **kwargs)
        if batch is not None and not kwargs:
            return await batch.call(target, list(args), timeout_s)
        return await pool.call(target, list(args), kwargs, timeout_s=timeout_s, kind=kind)

    return call


class RewardBatch:
    """Plain calls of one pool and kind made in the same turn of the event loop, sent as ONE call
    (``asyncrl.rewards.batch:each``, run in a worker like any other): the n rewards of a single-turn group,
    whose completions end together, and those of every other episode ending in the same engine step, cost
    one round trip to a worker instead of one each. Batching never changes an outcome: a batch that fails
    in any way (a timeout, a crash, a result that is not JSON) and any call in it that raised run again
    alone, as unbatched calls, each within its own timeout -- so the code may run twice for one call, and
    only code without side effects should be batched (``episode.batch_rewards``).

    Only fast code is batched: a batch's calls run one after another in one worker thread, alone they run
    side by side on the pool's threads. Until a target has a batch back, its calls go in batches of at most
    ``FIRST`` (a slow one waits behind 3 others at most; all alone, a burst of them -- the first evaluation's
    128 -- took a thread each and started every worker of the pool); while its batches take at most ``slow_s``
    a call in the worker, every call of a turn goes in one, and from the first slower or failed batch on, its
    calls go alone. Timing decides only how calls travel, never what they return."""

    _ALL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pool -> {kind: its RewardBatch}
    SLOW_S = 0.02  # a call this slow gains nothing from sparing its ~0.3 ms round trip
    FIRST = 4

    @classmethod
    def of(cls, pool: WorkerPool, kind: str) -> RewardBatch:
        """The one RewardBatch of ``pool`` and ``kind``: every episode's caller shares it."""
        batches = cls._ALL.setdefault(pool, {})
        if kind not in batches:  # made once, not at every episode's caller
            batches[kind] = cls(pool, kind)
        return batches[kind]

    def __init__(self, pool: WorkerPool, kind: str, slow_s: float = SLOW_S):
        self.pool, self.kind, self.slow_s = pool, kind, slow_s
        self.fast: dict[str, bool] = {}  # target -> its batches are fast (absent: not yet measured)
        self._waiting: dict[tuple[str, float], list[tuple[list, asyncio.Future]]] = {}
        self._sending: set[asyncio.Task] = set()

    async def call(self, target: str, args: list, timeout_s: float) -> Any:
        loop = asyncio.get_running_loop()
        if not self._waiting:  # the first of this turn: sent once every coroutine ready now has asked
            loop.call_soon(self._flush)
        answer = loop.create_future()
        self._waiting.setdefault((target, timeout_s), []).append((args, answer))
        return await answer

    def _flush(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for (target, timeout_s), calls in waiting.items():
            task = asyncio.ensure_future(self._send(target, timeout_s, calls))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, target: str, timeout_s: float, calls: list[tuple[list, asyncio.Future]]) -> None:
        calls = [(args, answer) for args, answer in calls if not answer.done()]  # not cancelled meanwhile
        fast = self.fast.get(target)
        size = 1 if fast is False else len(calls) if fast else self.FIRST  # unmeasured: batches of FIRST at most
        await asyncio.gather(*(self._batch(target, timeout_s, calls[i : i + size]) for i in range(0, len(calls), size)))

    async def _batch(self, target: str, timeout_s: float, batch: list[tuple[list, asyncio.Future]]) -> None:
        if len(batch) == 1:
            ((args, answer),) = batch
            await self._alone(target, args, timeout_s, answer)
            return
        results, alone = None, []
        try:
            done = await self.pool.call(
                EACH, [target, [args for args, _ in batch]], {}, timeout_s=timeout_s, kind=self.kind
            )
            results = done["results"]
            fast = done["seconds"] <= self.slow_s * len(batch)  # the worker's time: no queueing
        except Exception:  # noqa: BLE001 - the batch failed: each call alone says why, or succeeds
            fast = False
        self.fast[target] = self.fast.get(target, True) and fast  # once slow or failed, slow
        for i, (args, answer) in enumerate(batch):
            if results is not None and results[i][0]:
                if not answer.done():
                    answer.set_result(results[i][1])
            else:
                alone.append(self._alone(target, args, timeout_s, answer))
        await asyncio.gather(*alone)

    def _alone(self, target: str, args: list, timeout_s: float, answer: asyncio.Future) -> asyncio.Future:
        """The call sent by itself, started now; its answer (or error) handed to ``answer``."""
        return asyncio.ensure_future(self._call_alone(target, args, timeout_s, answer))

    async def _call_alone(self, target: str, args: list, timeout_s: float, answer: asyncio.Future) -> None:
        try:
            result = await self.pool.call(target, args, {}, timeout_s=timeout_s, kind=self.kind)
        except Exception as exc:  # noqa: BLE001 - handed to the caller, whose error it is
            if not answer.done():
                answer.set_exception(exc)
        else:
            if not answer.done():
                answer.set_result(result)


def plain_env_target(cls: type, spec: str) -> str | None:
    """``spec`` (the config's import path of ``cls``) when ``cls`` is a plain environment, whose
    sessions then run in the pool; None for one with an ``async`` ``reset`` or ``step``."""
    if any(is_async(getattr(cls, name, None)) for name in ("reset", "step")):
        return None
    return spec


class LocalEnv:
    """An environment instance in this process: ``async`` methods on the loop, plain ones on threads."""

    def __init__(self, env: Any, ctx: Context):
        self.env, self.ctx = env, ctx

    async def reset(self, task: dict, seed: int) -> Any:
        return await self.ctx.env_call(self.env.reset, task, seed)

    async def step(self, action: str) -> Any:
        return await self.ctx.env_call(self.env.step, action)

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            await self.ctx.env_call(close)


class PooledEnv:
    """An environment instance living in one worker process of the pool (a session)."""

    def __init__(self, session: Any, ctx: Context):
        self.session, self.ctx = session, ctx

    @classmethod
    async def open(cls, pool: WorkerPool, target: str, options: dict, ctx: Context) -> PooledEnv:
        session = await _timed(ctx, pool.open(target, options, timeout_s=ctx.step_timeout_s, kind="env"))
        return cls(session, ctx)

    async def reset(self, task: dict, seed: int) -> Any:
        return await _timed(self.ctx, self.session.call("reset", [task, seed], timeout_s=self.ctx.step_timeout_s))

    async def step(self, action: str) -> Any:
        return await _timed(self.ctx, self.session.call("step", [action], timeout_s=self.ctx.step_timeout_s))

    async def close(self) -> None:
        await _timed(self.ctx, self.session.close(timeout_s=self.ctx.step_timeout_s))


async def _timed(ctx: Context, call: Awaitable) -> Any:
    """One environment step, its duration counted (``episodes/env_seconds_per_step``)."""
    t0 = time.perf_counter()
    try:
        return await call
    finally:
        ctx.env_seconds.append(time.perf_counter() - t0)


def target_of(obj: Any) -> str | None:
    """``'module:qualname'`` of a function or class that a fresh interpreter can import by that name;
    None for lambdas, closures, ``__main__`` objects, builtins, partials, bound methods (run those on
    threads). A module the parent loaded from outside ``sys.path`` passes here and fails in a worker
    (``{kind}_error``, "cannot import")."""
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return None
    module, qualname = obj.__module__, obj.__qualname__
    if not module or module in ("__main__", "builtins") or "<" in qualname:
        return None
    found = sys.modules.get(module)
    if getattr(found, "__spec__", None) is None:
        return None
    for part in qualname.split("."):
        found = getattr(found, part, None)
    tools = sys.modules.get("asyncrl.episodes.tools")
    if tools is not None and isinstance(found, tools.Tool):
        found = found.fn  # a @tool's function, whose name holds the Tool: the worker unwraps it alike
    return f"{module}:{qualname}" if found is obj else None


__all__ = ["RewardBatch", "Caller", "LocalEnv", "PooledEnv", "caller", "plain_env_target", "target_of"]
