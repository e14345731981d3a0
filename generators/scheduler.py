"""The engine pump: one engine driven continuously for every episode of a generator.

Episodes are coroutines on the generator's one event loop. Each model turn is a request
``await pump.complete(prompt_ids, sampling)``: it is added to the engine at the pump's next pass, so
the engine never waits on an environment while another episode has a turn to sample. The pump's
loop, between engine steps:

  1. weights - if the ``WeightFeed`` has a newer version (and no evaluation holds the weights), apply
               it as ``generator.engine.on_weight_update`` says (then score the feed's probe, with
               no request in the engine: ``asyncrl.observe.probe``):
               ``continue``: every running turn is aborted and added again with its prompt plus the
               tokens it has, under the new weights (a prefill rebuilds its KV cache); the tokens
               after the switch carry the new version and the new policy's log-probs;
               ``abort``: every running turn starts again from its own prompt;
               ``wait``: no new turn starts until the running ones finish, then the weights load.
               An episode's turns may be of different versions under any mode: every token carries
               its own, and a group's version is its oldest model token's.
  2. cancel  - abort the requests of episodes that were cancelled (timeouts, shutdown)
  3. add     - start every queued turn
  4. step    - one ``engine.step()`` on the pump's own thread (the event loop goes on serving
               environments meanwhile), then hand each finished turn back to its episode

Concurrency: the engine is touched only by this loop, and never while a step runs: requests are
added and aborted, and weights loaded, between steps. ``idle_fraction`` is the share of wall time
the engine had no request at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import time
from typing import TYPE_CHECKING

from asyncrl.generators.engine import Completion, Engine, Sampling

if TYPE_CHECKING:
    from asyncrl.generators.weight_feed import WeightFeed
    from asyncrl.weights import WeightUpdate

IDLE_POLL_S = 0.05  # how often an idle pump looks for new weights (a new turn wakes it at once)


@dataclasses.dataclass(eq=False)
class _Turn:
    """One model turn being sampled, possibly across weight updates."""

    prompt: list[int]
    sampling: Sampling
    done: asyncio.Future
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)

    def completion(self, finish_reason: str) -> Completion:
        return Completion(self.tokens, self.logprobs, finish_reason, self.versions)


class EnginePump:
    def __init__(self, engine: Engine, feed: WeightFeed, on_update: str):
        self.engine, self.feed, self.on_update = engine, feed, on_update
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "engine", initializer=engine.bind_thread)
        self._queue: list[_Turn] = []
        self._live: dict[str, _Turn] = {}
        self._cancelled: list[str] = []
        self._wake = asyncio.Event()
        self._ids = itertools.count()
        self._holds = 0
        self._applying = False
        self._step: asyncio.Future | None = None
        self._waiting: WeightUpdate | None = None  # wait mode: an update deferred until turns finish
        self.busy_s = 0.0  # engine had requests
        self.idle_s = 0.0  # engine had none

    @property
    def version(self) -> int:
        return self.feed.version

    async def complete(self, prompt: list[int], sampling: Sampling) -> Completion:
        """One model turn of ``prompt``; every token with the version that produced it."""
        turn = _Turn(list(prompt), sampling, asyncio.get_running_loop().create_future())
        self._queue.append(turn)
        self._wake.set()
        try:
            return await turn.done
        except asyncio.CancelledError:
            self._forget(turn)
            raise

    @contextlib.asynccontextmanager
    async def hold(self):
        """No weights are applied while held (an evaluation must see one version); entered only
        between updates, so ``version`` read inside is the one every turn will be sampled with."""
        while self._applying:
            await asyncio.sleep(0.01)
        self._holds += 1
        try:
            yield
        finally:
            self._holds -= 1

    def take_idle_fraction(self) -> float | None:
        """Idle share of engine time since the last call."""
        total = self.busy_s + self.idle_s
        fraction = self.idle_s / total if total > 0 else None
        self.busy_s = self.idle_s = 0.0
        return fraction

    # -- the loop ------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Until cancelled."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._weights(loop)  # 1
                self._abort_cancelled()  # 2
                if self._waiting is None:  # 3
                    for turn in self._queue:
                        self._add(turn)
                    self._queue = []
                if not self._live:
                    t0 = time.perf_counter()
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)
                    self.idle_s += time.perf_counter() - t0
                    continue
                t0 = time.perf_counter()
                self._step = loop.run_in_executor(self._thread, self.engine.step)  # 4
                outs = await self._step
                self.busy_s += time.perf_counter() - t0
                for out in outs:
                    turn = self._live.get(out.request_id)
                    if turn is None:
                        continue
                    turn.tokens += out.tokens
                    turn.logprobs += out.logprobs
                    turn.versions += [self.version] * len(out.tokens)
                    if out.finished:
                        del self._live[out.request_id]
                        if not turn.done.done():
                            turn.done.set_result(turn.completion(out.finish_reason))
        finally:
            if self._step is not None and not self._step.done():  # never touch the engine mid-step
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._step)
            self.engine.abort_requests(list(self._live))
            for turn in [*self._queue, *self._live.values()]:
                turn.done.cancel()
            self._thread.shutdown(wait=False)

    async def _weights(self, loop) -> None:
        if self._holds:
            return
        update = self._waiting or self.feed.newer()
        if update is None:
            return
        if self.on_update == "wait" and self._live:
            self._waiting = update  # applied once the running turns finish
            return
        self._waiting = None
        running = list(self._live.values())
        self.engine.abort_requests(list(self._live))
        self._live = {}
        t0 = time.perf_counter()
        self._applying = True
        try:
            tensors = self.feed.engine_tensors(update)
            await loop.run_in_executor(self._thread, self.engine.load_weights, tensors)
            seconds = time.perf_counter() - t0
            probe = None
            if self.feed.probe_ids:  # nothing runs in the engine now: the probe has it to itself
                probe = await loop.run_in_executor(self._thread, self.engine.score, self.feed.probe_ids)
            self.feed.applied(update, seconds, probe)
        finally:
            self._applying = False
        for turn in running:  # only continue | abort get here with running turns
            if self.on_update == "abort":
                turn.tokens, turn.logprobs, turn.versions = [], [], []
            self._add(turn)

    def _add(self, turn: _Turn) -> None:
        if turn.done.done():  # cancelled while queued
            return
        left = turn.sampling.max_new_tokens - len(turn.tokens)
        if left <= 0:  # continued up to its limit exactly at an update
            turn.done.set_result(turn.completion("length"))
            return
        request_id = f"turn-{next(self._ids)}"
        sampling = dataclasses.replace(turn.sampling, max_new_tokens=left)
        self.engine.add_request(request_id, turn.prompt + turn.tokens, sampling)
        self._live[request_id] = turn

    def _forget(self, turn: _Turn) -> None:
        if turn in self._queue:
            self._queue.remove(turn)
        self._cancelled += [rid for rid, t in self._live.items() if t is turn]

    def _abort_cancelled(self) -> None:
        if self._cancelled:
            self.engine.abort_requests(self._cancelled)
            for rid in self._cancelled:
                self._live.pop(rid, None)
            self._cancelled = []
