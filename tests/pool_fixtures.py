"""A fresh worker pool for one test, on its own event loop (the pool's and the reward batch's tests)."""

from __future__ import annotations

import asyncio

from asyncrl.service.pool import WorkerPool


def in_pool(test, **options):
    """Run ``test(pool)`` on a fresh event loop with a fresh pool, closed afterwards whatever happened;
    fail on anything the loop reports (a task's exception never retrieved, a callback that raised)."""
    reported = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
        pool = WorkerPool(**options)
        try:
            return await test(pool)
        finally:
            await pool.aclose()

    result = asyncio.run(main())
    assert reported == []
    return result
