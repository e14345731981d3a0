"""A batch of reward calls as one call in a worker of the generator's pool (``asyncrl.episodes.user_code.RewardBatch``).

The worker runs :func:`each` like any plain call: it imports the reward by its path and scores every item in
turn. Nothing here is imported by the generator; the worker imports this module alone (no numpy, no torch),
so it costs a fresh worker nothing.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

EACH = "asyncrl.rewards.batch:each"  # the target the parent names


def each(target: str, calls: list[list]) -> dict:
    """``{"results": [[ok, value], ...], "seconds": s}``: for each ``args`` in ``calls``, in order, ``[True, the
    result of target(*args)]`` or ``[False, None]`` where it raised (the parent runs that call again alone,
    which reports its error as an unbatched call does); ``seconds``: the time the calls took here."""
    module, _, qualname = target.partition(":")
    fn: Any = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    started, results = time.perf_counter(), []
    for args in calls:
        try:
            results.append([True, fn(*args)])
        except Exception:  # noqa: BLE001 - this call's own error: the parent asks it again alone
            results.append([False, None])
    return {"results": results, "seconds": time.perf_counter() - started}
