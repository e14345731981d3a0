"""``asyncrl reward-serve``: any reward function over HTTP, from a pool of killable worker processes.

    asyncrl reward-serve --reward asyncrl.rewards.math_answer:math_reward --workers 8 --deadline-s 10

The wire protocol (``asyncrl.reward`` version 1) is documented in :mod:`asyncrl.rewards.remote`; the
HTTP side (token, limits, answer cache, signals) is the service kit's, :mod:`asyncrl.service.http`.

* **A hard deadline per item.** The rewards run on :class:`~asyncrl.service.pool.WorkerPool` (kind
  ``reward``): ``--workers`` processes, each computing one item at a time. An item with no answer
  ``deadline_s`` after its worker took it is answered ``error`` (cause ``reward_timeout``); the worker
  is killed (SIGKILL, by pid) and another started when an item next needs one, so a hung reward costs
  one worker for one deadline, never the server. A worker that dies mid-item answers ``reward_error``
  and is replaced the same way. Queueing for a free worker, and a worker's start (its import of the
  reward module, within :data:`READY_TIMEOUT_S`), do not count against the deadline: keep
  ``deadline_s`` well under the clients' ``episode.reward_timeout_s``.
* **Checked at start.** Every worker is started, and must import the reward, before the server
  listens; one that cannot is a one-line error (exit code 2).
* **Idempotent by request id.** Answers (``error`` answers too) of the last
  :data:`~asyncrl.service.http.CACHE_SIZE` ids are kept; a repeated id is answered from there without
  calling the reward again, and one that arrives while the first still computes waits for that same
  computation, which is not tied to its HTTP request: a client that disconnects still leaves the answer
  for its retry.
* **No pickle across processes.** Only JSON crosses to a worker and back (the pool's wire); a worker's
  prints go to stderr, never into that channel. Workers die with the server and ignore SIGINT: Ctrl-C
  stops the server, which stops its workers.
* **Loopback and a token by default.** The server binds 127.0.0.1 unless told otherwise and needs
  ``Authorization: Bearer <token>`` on every request. The token is read from ``--token-file`` (made,
  0600, when missing), else ``$ASYNCRL_REWARD_TOKEN``, else generated into a temporary 0600 file
  removed at exit. Only the file's path is ever printed or logged.
* **Strict about requests.** A body must arrive within a read deadline (seconds, more for a large
  body), else it is answered 408 and its connection closed. A body nested deeper than
  :data:`~asyncrl.service.http.MAX_DEPTH` and a request with a field the protocol does not name are
  answered 400, naming the depth or the fields: the client (``asyncrl.rewards.remote``) sends exactly
  the protocol's fields, so an unknown one is a client of another protocol or version.
* **Signals.** SIGINT (Ctrl-C) and SIGTERM stop the server at any point, start-up included, even
  when it was started with SIGINT ignored (a background job of a non-interactive shell): it exits
  130 on SIGINT and 143 on SIGTERM, after answering 503 to what was still computing and stopping its
  workers.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
from collections.abc import Mapping

from asyncrl.data import import_by_path
from asyncrl.errors import EpisodeFailure, UserError
from asyncrl.rewards.remote import SCHEMA, TOKEN_ENV, VERSION
from asyncrl.rewards.resolve import one_line, reward_parts
from asyncrl.service import http
from asyncrl.service.pool import WorkerFault, WorkerPool

log = logging.getLogger("asyncrl.rewards.serve")

READY_TIMEOUT_S = 120.0  # a worker's start-up: a heavy reward module (sympy, torch) can take this long to import
FIELDS = {"prompt": str, "completion": str, "record": dict}  # a version-1 request, besides schema, version and id


# ----- worker process side: run by the pool's workers --------------------------------------------


def score_item(reward: str, prompt: str, completion: str, record: dict) -> dict:
    """``reward`` on one item, judged like :func:`asyncrl.rewards.resolve.score` judges a local reward:
    ``{"reward": x}``, ``{"parts": {...}}`` or ``{"error": str, "cause": str}``."""
    fn = import_by_path(reward)  # imported when the worker started: a lookup
    try:
        value = fn(prompt, completion, record)
        if inspect.iscoroutine(value):
            value = asyncio.run(value)
        parts = reward_parts(value)
    except EpisodeFailure as exc:
        return {"error": exc.detail or exc.cause, "cause": exc.cause}
    except Exception as exc:  # noqa: BLE001 - the user's reward: any error is an answer
        return {"error": one_line(exc), "cause": "reward_error"}
    return {"parts": parts} if isinstance(value, Mapping) else {"reward": parts["reward"]}


def reward_problem(reward: str) -> str | None:
    """Why a worker cannot import ``reward`` (the start-up check), or None."""
    try:
        import_by_path(reward)
    except UserError as exc:
        return str(exc)
    return None


# ----- the server ----------------------------------------------------------------------------------


class RewardService:
    """``POST /score``: the protocol, behind the token, answered from the cache or the pool."""

    def __init__(self, pool: WorkerPool, reward: str, token: str, deadline_s: float):
        self.pool, self.reward, self.deadline_s = pool, reward, deadline_s
        self.door = http.Door(token)
        self.answers = http.Answers(SCHEMA, VERSION, waiting="pending")

    def app(self):
        app = http.new_app()
        app.router.add_post("/score", self.score)
        return app

    async def score(self, request):
        try:
            msg = await self.door.message(request, lambda body: http.check_request(body, SCHEMA, VERSION, FIELDS))
            asked = [msg["prompt"], msg["completion"], msg["record"]]
            return await self.answers.answer(msg["id"], http.digest_of(asked), lambda: self._score(asked))
        except http.Refused as refused:
            return refused.response()

    async def _score(self, asked: list) -> dict:
        """The item's answer; a worker's fault is an ``error`` answer, never an exception."""
        try:
            target = f"{__name__}:score_item"
            return await self.pool.call(target, [self.reward, *asked], {}, timeout_s=self.deadline_s, kind="reward")
        except EpisodeFailure as failure:
            return fault_answer(failure, self.deadline_s)


def fault_answer(failure: EpisodeFailure, deadline_s: float) -> dict:
    """What an item whose worker failed it answers: ``reward_timeout`` when it hung (its worker killed),
    else ``reward_error`` (its worker died under it, or the pool could not run it)."""
    what = failure.what if isinstance(failure, WorkerFault) else None
    if what == "timeout":
        return {"error": f"no answer within the {deadline_s:g} s deadline (worker killed)", "cause": "reward_timeout"}
    if what in ("crash", "memory", "lost"):
        return {"error": f"{failure.detail} while computing the reward", "cause": "reward_error"}
    return {"error": failure.detail or failure.cause, "cause": failure.cause}  # the pool's reward_error, say


def serve(reward: str, *, host="127.0.0.1", port=0, workers=None, deadline_s=20.0, token_file=None) -> int:
    """Serve ``reward`` until SIGINT (returns 130) or SIGTERM (143); prints its URL (never its token)
    once it is ready."""
    from asyncrl.observe.metrics import setup_logging

    workers = workers if workers is not None else (os.cpu_count() or 1)
    if workers < 1 or deadline_s <= 0 or not 0 <= port <= 65535:
        raise UserError("reward-serve needs --workers >= 1, --deadline-s > 0 and a --port in 0..65535")
    setup_logging(name="reward-serve")
    main = functools.partial(_serve, reward, host, port, workers, deadline_s)  # main(token, token_path)
    return http.serve_until_signal(main, token_file, TOKEN_ENV, "asyncrl-reward-", log)


async def _serve(reward, host, port, workers, deadline_s, token, token_path) -> None:
    """Serve until cancelled (by :func:`~asyncrl.service.http.until_signal`)."""
    preload = (reward, f"{__name__}:score_item")  # imported as a worker starts, not within an item's deadline
    name = f"reward-serve {reward}"
    pool = WorkerPool(workers=workers, threads=1, name=name, start_timeout_s=READY_TIMEOUT_S, preload=preload)
    try:
        await _start_workers(pool, reward, workers)
        service = RewardService(pool, reward, token, deadline_s)
        async with http.listening(service.app(), host, port, log) as url:
            shape = f"{workers} workers, deadline {deadline_s:g} s"
            http.announce("reward-serve", reward, f"{url}/score", shape, token_path, TOKEN_ENV, "data.reward")
            try:
                await asyncio.Future()  # forever: until a signal cancels this
            finally:
                await service.answers.stop()  # their requests answer 503
    finally:
        await pool.aclose()


async def _start_workers(pool: WorkerPool, reward: str, workers: int) -> None:
    """Start every worker (one check each: with one thread apiece, each goes to a worker of its own);
    :class:`UserError` unless each one imports ``reward``."""
    check = f"{__name__}:reward_problem"
    calls = [pool.call(check, [reward], {}, timeout_s=READY_TIMEOUT_S, kind="reward") for _ in range(workers)]
    try:
        problems = await asyncio.gather(*calls)
    except EpisodeFailure as failure:
        raise UserError(failure.detail or failure.cause) from None  # "a worker for reward-serve ... did not start"
    for problem in problems:
        if problem:
            raise UserError(problem)
