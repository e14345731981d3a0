"""Where user code runs: the one place that decides, for every environment, tool and reward call.

* ``async`` code runs on the generator's event loop. It is the default because it cannot block the
  loop (it yields at every ``await``), a timeout cancels it cleanly (no thread or process is left
  holding it), and it costs nothing per call: the guess demo's environments and remote rewards are
  ``async`` for this reason. Its one risk is native code crashing the process; write such code plain.
* Plain (blocking) code runs in the generator's :class:`~asyncrl.episodes.pool.WorkerPool` under
  ``episode.plain_code: process`` (the default): killable worker processes, a hard deadline per call,
  a crash or memory blow-up ending only the episodes whose calls or sessions that worker held
  (``env_timeout``, ``env_crash``, ``env_memory``, ``env_lost``; ``tool_*`` and ``reward_*`` alike). The
  code must be importable by path in a fresh interpreter (a module-level function or class); what is
  not (a lambda, a closure, something defined in ``__main__``) runs on a thread, as under
  ``episode.plain_code: thread``, where a call that never returns keeps its thread past its timeout.

An environment class runs as one **session** per episode: its instance is built inside one worker and
every ``reset``/``step``/``close`` of that episode goes to it (it is stateful).
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from asyncrl.data import call_bounded, is_async
from asyncrl.episodes.pool import WorkerPool

if TYPE_CHECKING:
    from asyncrl.episodes.api import Context

Caller = Callable[..., Awaitable[Any]]  # (fn, timeout_s, *args, **kwargs) -> fn's result, like call_bounded


def caller(pool: WorkerPool | None, kind: str) -> Caller:
    """A :func:`~asyncrl.data.call_bounded`-shaped caller that runs plain, importable code in ``pool``
    (its faults raised as :class:`EpisodeFailure` ``{kind}_timeout`` / ``_crash`` / ``_memory`` /
    ``_error``), and everything else as ``call_bounded`` does (``TimeoutError``, or the code's own error)."""

    async def call(fn: Callable, timeout_s: float, *args: Any, **kwargs: Any) -> Any:
        target = None if pool is None or is_async(fn) else target_of(fn)
        if target is None:
            return await call_bounded(fn, timeout_s, *args, **kwargs)
        return await pool.call(target, list(args), kwargs, timeout_s=timeout_s, kind=kind)

    return call


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


__all__ = ["Caller", "LocalEnv", "PooledEnv", "caller", "plain_env_target", "target_of"]
