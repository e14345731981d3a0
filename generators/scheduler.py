"""The engine pump: one engine driven continuously for every episode of a generator.

Episodes are coroutines on the generator's one event loop. Each model turn is a request
``await pump.complete(prompt_ids, sampling)``: it is added to the engine at the pump's next pass, so
the engine never waits on an environment while another episode has a turn to sample.
``await pump.complete_many(prompt_ids, sampling, n)`` samples n turns of one prompt (a single-turn
group) as ONE engine request of n samples where the engine supports it (``Engine.multi_sample``: the
prompt's prefill is shared, one request to add and to track), else as n requests; either way each
sample is its own turn below, with its own tokens, log-probs and versions. The pump's loop, between
engine steps:

  1. weights - if the ``WeightFeed`` has a newer version (and no evaluation holds the weights: one that
               comes during a hold is taken and waits for its end, ``weights/held_seconds``), apply
               it as ``generator.engine.on_weight_update`` says, and score the feed's probe
               (``asyncrl.observe.probe``) with it: in the next step, with the turns, where the engine
               can (``Engine.scores_alongside``), else at once, alone in the engine:
               ``continue``: every running turn is aborted and added again with its prompt plus the
               tokens it has, under the new weights (a prefill rebuilds its KV cache); the tokens
               after the switch carry the new version and the new policy's log-probs; a running
               n-sample request is split: each unfinished sample goes on as a request of its own;
               ``abort``: every running turn starts again from its own prompt (an n-sample
               request's unfinished samples each as a request of its own, its finished ones kept);
               ``wait``: no new turn starts until the running ones finish, then the weights load.
               An episode's turns may be of different versions under any mode: every token carries
               its own, and a group's version is its oldest model token's.
  2. cancel  - abort the requests of episodes that were cancelled (timeouts, shutdown)
  3. add     - start every queued turn (the n fresh turns of a ``complete_many`` as one request)
  4. step    - one ``engine.step()`` on the pump's own thread (the event loop goes on serving
               environments meanwhile), then hand each finished turn back to its episode (the
               samples of one request finish one by one: each is handed back when it ends)

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

from asyncrl.chat import Completion
from asyncrl.generators.engine import Engine, Sampling, StepOutput

if TYPE_CHECKING:
    import numpy as np

    from asyncrl.generators.prompts import Prompt
    from asyncrl.generators.weight_feed import WeightFeed
    from asyncrl.weights import WeightUpdate

IDLE_POLL_S = 0.05  # how often an idle pump looks for new weights (a new turn wakes it at once)


@dataclasses.dataclass(eq=False)
class _Turn:
    """One model turn being sampled, possibly across weight updates."""

    prompt: list[int]
    sampling: Sampling
    done: asyncio.Future
    images: tuple = ()  # the prompt's images (a vision-language model's), one image token each in ``prompt``
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False  # the engine ended it (its request may still run other samples)
    routes: np.ndarray | None = None  # rollout routing replay: the finished request's (StepOutput.routes)

    def completion(self, finish_reason: str) -> Completion:
        return Completion(self.tokens, self.logprobs, finish_reason, self.versions, self.routes)


class EnginePump:
    def __init__(self, engine: Engine, feed: WeightFeed, on_update: str):
        self.engine, self.feed, self.on_update = engine, feed, on_update
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "engine", initializer=engine.bind_thread)
        self._queue: list[tuple[_Turn, ...]] = []  # turns to add; the turns of one complete_many together
        self._live: dict[str, tuple[_Turn, ...]] = {}  # request id -> its turns, by sample index
        self._cancelled: list[str] = []
        self._wake = asyncio.Event()
        self._ids = itertools.count()
        self._holds = 0
        self._applying = False
        self._step: asyncio.Future | None = None
        self._waiting: WeightUpdate | None = None  # wait mode: an update deferred until turns finish
        self._held: WeightUpdate | None = None  # the newest update that came while an evaluation held the weights
        self._held_since: float | None = None  # ... since when one waited (monotonic)
        self._held_seconds = 0.0  # how long the update applied next waited for a hold: weights/held_seconds
        self._probing = False  # the probe of the served version is in the engine, scored by the next step
        self.busy_s = 0.0  # engine had requests
        self.idle_s = 0.0  # engine had none
        self.steps = 0  # engine steps, and the samples running in them (the batch), since the last report
        self.stepped_samples = 0

    @property
    def version(self) -> int:
        return self.feed.version

    @property
    def next_version(self) -> int:
        """The version a turn queued now will be sampled with: under ``wait``, an update held back until
        the running turns finish is that version (no new turn starts before it loads)."""
        return self._waiting.version if self._waiting is not None else self.feed.version

    async def complete(self, prompt: list[int], sampling: Sampling, images: tuple = ()) -> Completion:
        """One model turn of ``prompt`` (showing ``images``); every token with the version that produced it."""
        loop = asyncio.get_running_loop()
        (completion,) = await self._submit((_Turn(list(prompt), sampling, loop.create_future(), tuple(images)),))
        return completion

    async def complete_many(
        self, prompt: list[int], sampling: Sampling, n: int, images: tuple = ()
    ) -> list[Completion]:
        """``n`` model turns of ``prompt`` (``sampling.n`` is ignored), sampled independently, as one
        n-sample engine request where the engine supports it; each completion as ``complete`` gives it
        (its tokens' versions may differ from its siblings' when an update split the request)."""
        loop = asyncio.get_running_loop()
        turns = tuple(_Turn(list(prompt), sampling, loop.create_future(), tuple(images)) for _ in range(n))
        return await self._submit(turns)

    async def _submit(self, turns: tuple[_Turn, ...]) -> list[Completion]:
        self._queue.append(turns)
        self._wake.set()
        try:
            if len(turns) == 1:
                return [await turns[0].done]
            return list(await asyncio.gather(*(t.done for t in turns)))
        except asyncio.CancelledError:
            self._forget(turns)
            raise

    @contextlib.asynccontextmanager
    async def hold(self):
        """No weights are applied while held (an evaluation must see one version); entered only
        between updates, so ``version`` read inside is the one every turn will be sampled with. Under
        ``wait``, an update held back for the running turns lands first: held, it never would, and no
        new turn (the holder's included) would ever start."""
        while self._applying or self._waiting is not None or self._held is not None:
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

    def take_batch_stats(self) -> dict[str, float]:
        """Engine steps since the last call and the samples each ran on average (the batch)."""
        record = {"engine/steps": self.steps}
        if self.steps:
            record["engine/batch_mean"] = self.stepped_samples / self.steps
        self.steps = self.stepped_samples = 0
        return record

    # -- the loop ------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Until cancelled."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._weights(loop)  # 1
                self._abort_cancelled()  # 2
                if self._waiting is None:  # 3
                    for turns in self._queue:
                        self._add(turns)
                    self._queue = []
                if not self._live and not self._probing:
                    t0 = time.perf_counter()
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)
                    self.idle_s += time.perf_counter() - t0
                    continue
                self.steps += 1
                self.stepped_samples += sum(not t.finished for turns in self._live.values() for t in turns)
                t0 = time.perf_counter()
                self._step = loop.run_in_executor(self._thread, self.engine.step)  # 4
                outs = await self._step
                self.busy_s += time.perf_counter() - t0
                self._deliver(outs)
                if self._probing and (scored := self.engine.take_score()) is not None:
                    self._probing = False
                    self.feed.probed(scored)
        finally:
            if self._step is not None and not self._step.done():  # never touch the engine mid-step
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._step)
            self.engine.abort_requests(list(self._live))
            with contextlib.suppress(Exception):  # and the last version's record, while Redis is there
                self._drop_probe()
            for turns in [*self._queue, *self._live.values()]:
                for turn in turns:
                    turn.done.cancel()
            self._thread.shutdown(wait=False)

    def _deliver(self, outs: list[StepOutput]) -> None:
        """A step's new tokens to their turns; a finished turn back to its episode; a request leaves
        ``_live`` when every one of its samples finished."""
        for out in outs:
            turns = self._live.get(out.request_id)
            if turns is None:
                continue
            turn = turns[out.index]
            turn.tokens += out.tokens
            turn.logprobs += out.logprobs
            turn.versions += [self.version] * len(out.tokens)
            if out.finished:
                turn.finished, turn.routes = True, out.routes
                if not turn.done.done():
                    turn.done.set_result(turn.completion(out.finish_reason))
                if all(t.finished for t in turns):
                    del self._live[out.request_id]

    async def _weights(self, loop) -> None:
        if self._holds:  # taken (the newest), to be applied when the hold ends; how long it waited is logged
            if (newer := self.feed.newer()) is not None:
                self._held, self._held_since = newer, self._held_since or time.monotonic()
            return
        update = self._held or self._waiting or self.feed.newer()
        if update is None:
            return
        if self._held is not None:  # the hold ended: its wait is measured here, not a later one for running turns
            self._held_seconds = time.monotonic() - self._held_since
            self._held = self._held_since = None
        if self.on_update == "wait" and self._live:
            self._waiting = update  # applied once the running turns finish
            return
        self._waiting = None
        held, self._held_seconds = self._held_seconds, 0.0
        self._drop_probe()  # still unscored (its prefill split over steps): it would see two versions
        running = [t for turns in self._live.values() for t in turns if not t.finished]  # split per sample
        self.engine.abort_requests(list(self._live))
        self._live = {}
        t0 = time.perf_counter()
        self._applying = True
        try:
            tensors = self.feed.engine_tensors(update)
            await loop.run_in_executor(self._thread, self.engine.load_weights, tensors)
            seconds = time.perf_counter() - t0
            ids = self.feed.probe_for(update)
            probe, self._probing = None, bool(ids) and self.engine.scores_alongside
            if self._probing:  # one more prompt in the next step, with the turns
                self.engine.start_score(ids)
            elif ids:  # nothing runs in the engine now: the probe has it to itself
                probe = await loop.run_in_executor(self._thread, self.engine.score, ids)
            routing = self.engine.probe_routing if probe is not None else None
            self.feed.applied(update, seconds, probe, routing, probe_to_come=self._probing, held_seconds=held)
        finally:
            self._applying = False
        for turn in running:  # only continue | abort get here with running turns
            if self.on_update == "abort":
                turn.tokens, turn.logprobs, turn.versions = [], [], []
            self._add((turn,))

    def _drop_probe(self) -> None:
        """The served version's probe leaves the engine unscored; its record goes out without it."""
        if self._probing:
            self._probing = False
            self.engine.abort_score()
            self.feed.probed(None)

    def _add(self, turns: tuple[_Turn, ...]) -> None:
        """Start ``turns`` (of one prompt and sampling): fresh ones as one n-sample request where the
        engine takes it, else (or once they hold tokens) each as a request of its own."""
        turns = tuple(t for t in turns if not t.done.done())  # cancelled while queued
        if len(turns) > 1 and self.engine.multi_sample and not any(t.tokens for t in turns):
            request_id = f"turn-{next(self._ids)}"
            sampling = dataclasses.replace(turns[0].sampling, n=len(turns))
            self.engine.add_request(request_id, turns[0].prompt, sampling, turns[0].images)
            self._live[request_id] = turns
            return
        for turn in turns:
            left = turn.sampling.max_new_tokens - len(turn.tokens)
            if left <= 0:  # continued up to its limit exactly at an update
                turn.finished = True
                turn.done.set_result(turn.completion("length"))
                continue
            request_id = f"turn-{next(self._ids)}"
            sampling = dataclasses.replace(turn.sampling, n=1, max_new_tokens=left)
            self.engine.add_request(request_id, turn.prompt + turn.tokens, sampling, turn.images)
            self._live[request_id] = (turn,)

    def _forget(self, turns: tuple[_Turn, ...]) -> None:
        if turns in self._queue:
            self._queue.remove(turns)
        mine = set(turns)
        self._cancelled += [rid for rid, live in self._live.items() if mine.intersection(live)]

    def _abort_cancelled(self) -> None:
        if self._cancelled:
            self.engine.abort_requests(self._cancelled)
            for rid in self._cancelled:
                self._live.pop(rid, None)
            self._cancelled = []


class GroupTurns:
    """A ``Context``'s ``complete`` shared by the n single-turn episodes of one group: their first turns
    of the group's prompt are one ``complete_many`` of n samples, sent at the first ask, the i-th
    completion to the i-th asker. Any other turn (another context, a smaller limit, an n+1-th) is its
    own ``complete``. One episode cancelled (its timeout) leaves the others' samples running;
    :meth:`cancel` (the group's end) stops whatever still runs."""

    def __init__(self, pump: EnginePump, prompt: Prompt, sampling: Sampling, n: int):
        self.pump, self.prompt, self.sampling, self.n = pump, list(prompt.ids), sampling, n
        self.images = prompt.images
        self._asked = 0
        self._many: asyncio.Future | None = None

    async def __call__(self, ids: list[int], max_new_tokens: int) -> Completion:
        if self._asked >= self.n or max_new_tokens != self.sampling.max_new_tokens or list(ids) != self.prompt:
            sampling = dataclasses.replace(self.sampling, max_new_tokens=max_new_tokens)
            return await self.pump.complete(ids, sampling, self.images)
        i, self._asked = self._asked, self._asked + 1
        if self._many is None:
            self._many = asyncio.ensure_future(self.pump.complete_many(self.prompt, self.sampling, self.n, self.images))
        return (await asyncio.shield(self._many))[i]

    def cancel(self) -> None:
        if self._many is not None:
            self._many.cancel()
