"""The sandboxed Python tool: ``python`` (``asyncrl.episodes.sandbox:python`` in ``episode.tools``) runs its one
argument, ``code``, as a program of its own in a fresh, limited, network-less interpreter and answers with what it
printed (:mod:`asyncrl.service.sandbox` says how, and what each limit does). :func:`make_python_tool` builds one
with other :class:`Limits` or another name.
"""

from __future__ import annotations

from asyncrl.episodes.tools import Tool, tool
from asyncrl.service.sandbox import CLEANUP_S, WALL_S, Limits, run_python, sandbox_uids

__all__ = ["WALL_S", "Limits", "make_python_tool", "python", "run_python", "sandbox_uids"]


def make_python_tool(name: str = "python", **limits: float) -> Tool:
    """A sandboxed Python tool named ``name`` with these :class:`Limits` (``cpu_s=2, memory_mb=256``; an unknown
    one is a ``TypeError``); the tool machinery's own timeout is ``wall_s`` plus a margin for the cleanup."""
    bounds = Limits(**limits)

    async def run(code: str) -> str:
        return await run_python(code, bounds)

    run.__doc__ = (
        "Run a Python 3 program in a fresh sandbox and return what it prints (stdout, then stderr); print what "
        f"you need to see. Each call starts from nothing. Limits: {bounds.cpu_s} s CPU, {bounds.wall_s:g} s in all, "
        f"{bounds.memory_mb} MB memory, {bounds.output_bytes} bytes of output."
    )
    return tool(run, name=name, timeout_s=bounds.wall_s + CLEANUP_S)


python = make_python_tool()
