"""The back-off every retrying client of asyncrl uses (the Redis buffer, the remote reward)."""

from __future__ import annotations

import random


def backoff_s(attempt: int, base_s: float, cap_s: float) -> float:
    """Sleep before retry number ``attempt``: "equal jitter" exponential back-off.

    Half of ``min(cap, base * 2**attempt)`` is fixed, so the retries together always wait at least
    about half their nominal sum (the buffer's 0.1 s base, 2 s cap, 6 retries: 3.5 to 7 s, which rides
    through a server restart); the random half keeps many clients from reconnecting in lockstep.
    """
    t = min(cap_s, base_s * 2**attempt) / 2
    return t + random.uniform(0, t)
