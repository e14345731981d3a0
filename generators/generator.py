"""A generator's loop: an episode scheduler that turns tasks into scored trajectory groups (its process is
``asyncrl.generators.worker``).

One event loop runs up to ``generator.episodes_in_flight`` episodes (whole groups: a group is
``n_samples`` episodes of one task) and one :class:`~asyncrl.generators.scheduler.EnginePump` that
samples their turns continuously. The loop, every ``TICK_S`` or when a group ends:

  0. lease   - every ``TICK_S`` only (not at each group's end: its Redis round trips would hold the loop):
               the run's stop, renew this generator's lease in the fleet (``RunControl.renew``; a thread
               renews it between ticks: ``generators.lease``) and read the fleet's size; a lost lease
               (the launcher reaped it and gave its slots back) ends the process before it claims or
               pushes anything more
  1. eval    - if the served version reached an eval point (at it, or past it: ``evaluation``) that no
               other generator claimed, start a greedy held-out evaluation of it (it holds the weights
               until done: one version throughout)
  2. admit   - on a thread, take orphans (groups of a generator that died, resumed from their
               journal: ``asyncrl.generators.journal``), then claim groups under admission control,
               keyed on the version their turns will be sampled with (under ``wait``, an update
               waiting for the running turns), while there is room, the share sized by the live
               fleet (found closed, it is asked again at a new version or the tick, not at each group's
               end); each group runs as its own task: n episodes -> one trajectory group -> push
  3. report  - metrics every ``REPORT_S``; stop the run when failures pass the limit
               (``episode.failure_limit``)

SIGTERM ends the loop the same way the run's stop does: unfinished groups are cancelled, their slots
given back (journaled ones are orphaned instead while the run goes on, their sessions left open for the
generator that resumes them), and the generator leaves the fleet at once (no lease left to expire).

Weights are applied by the pump between engine steps (``generator.engine.on_weight_update``).

Group outcomes: pushed (every sample with its status), or, when an episode failed under
``episode.failure_policy: drop_group`` (or every episode failed), ``failed``: not pushed, its admission
slot given back and counted. Slots of groups that never reach the buffer (too-long prompts, shutdown) are
given back as ``abandoned``. Every claim, push and release names this generator as the group's producer,
so the buffer knows, atomically, which groups it holds: those of a generator killed at any instant are
what the launcher gives back, or orphans when journaled (``Buffer.release_held``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time

from asyncrl.buffers.base import live_groups
from asyncrl.chat import ChatTokens
from asyncrl.config import Config
from asyncrl.control import MEMBER_TTL_S, RunControl
from asyncrl.data.sources import open_evals, open_train
from asyncrl.episodes.api import Context, Outcome, run_episode, single_turn
from asyncrl.episodes.kinds import load_episode
from asyncrl.generators.accounting import EpisodeStats, FailureWindow, threads_and_children
from asyncrl.generators.engine import Engine, Sampling, fits, turn_sampling
from asyncrl.generators.evaluation import (
    SAMPLE_EVERY,
    SAMPLE_ITEMS,
    HeldOut,
    eval_points,
    eval_record,
    eval_samples,
    held_out,
    points_reached,
    sample_items,
    samples_record,
)
from asyncrl.generators.journal import GroupJournal
from asyncrl.generators.lease import LeaseKeeper, LeaseLost
from asyncrl.generators.outcomes import episode_seed, to_sample
from asyncrl.generators.prompts import Prompt, Prompts, vision_for
from asyncrl.generators.scheduler import EnginePump, GroupTurns
from asyncrl.generators.weight_feed import WeightFeed
from asyncrl.keys import LAST_EVAL_FIELD
from asyncrl.observe import probe
from asyncrl.observe.metrics import RedisSink
from asyncrl.protocol import TrajectoryGroup, encode_group
from asyncrl.rewards.resolve import RunRewards
from asyncrl.service.pool import WorkerPool
from asyncrl.staleness import admission_limit, claim_share
from asyncrl.weights import WeightSubscriber

log = logging.getLogger("asyncrl.generator")

TICK_S = 0.2  # the fleet's pace (stop flag, lease, fleet size, orphans), and the loop's when nothing happens
REPORT_S = 2.0  # metrics interval: often enough for the progress line, rare enough for hundreds of episodes


class Generator:
    def __init__(
        self,
        cfg: Config,
        *,
        ident: str,
        engine: Engine,
        buffer,
        control: RunControl,
        tokenizer,
        subscriber: WeightSubscriber,
    ):
        """The weights on disk, which ``engine`` starts from, are version 0."""
        self.cfg, self.ident = cfg, ident
        self.engine, self.buffer, self.control = engine, buffer, control
        self.metrics = RedisSink(control, f"generator/{ident}")
        self.fleet = 1  # live generators, as of the last tick (admission shares are sized by it)
        self.stopping = False  # SIGTERM: leave the run cleanly
        ep = cfg.episode
        self.chat = ChatTokens(tokenizer, use_template=ep.chat_template, system_prompt=ep.system_prompt)
        self.train, evals = open_train(cfg), open_evals(cfg)
        vision = vision_for(any(s.has_images for s in [*self.train.sets, *evals]), cfg.model.path)
        self.prompts = [Prompts(self.chat, vision, s.base_dir) for s in self.train.sets]  # per source: its images
        self.feed = WeightFeed(
            subscriber,
            self.metrics,
            self._served,
            probe_ids=probe.probe_ids(self.chat, self.train.sets[0][0], vision),
            compare=lambda version, logprobs, routing=None: probe.compare(control, version, logprobs, routing),
            sampled=lambda version: probe.ids_of(control, version),
            aliases=json.loads(control.get_meta("tied") or "{}"),  # the learner's, before its first version
            adapter=(cfg.model.path, cfg.model.lora.alpha / cfg.model.lora.rank) if cfg.model.lora else None,
        )
        self.pump = EnginePump(engine, self.feed, cfg.generator.engine.on_weight_update)
        self.episode, self.tools, self.parser = load_episode(ep)
        # plain environments, tools and rewards: killable worker processes, started at their first call
        self.pool = (
            WorkerPool(workers=ep.workers, threads=ep.worker_threads, memory_mb=ep.worker_memory_mb)
            if ep.plain_code == "process"
            else None
        )
        self.peaks = {"generator/threads_peak": 0, "generator/child_processes_peak": 0}
        self.rewards = RunRewards(cfg.data, ep.reward_timeout_s)  # by train source, and by eval set
        self.due_evals = eval_points(cfg.run.steps, cfg.run.eval_every) if cfg.evaluates else set()
        self.due_samples = set(range(0, cfg.run.steps + 1, SAMPLE_EVERY))  # training samples (samples.jsonl)
        g, stops = cfg.generator, tuple(self.chat.stop_token_ids)
        self.sampling = turn_sampling(g, stops)
        self.greedy = turn_sampling(g, stops, greedy=True, tokens_only=self.episode is single_turn)
        self.eval_sets: list[HeldOut] = []  # encoded once, seeded once (~30 us a seed)
        for spec, prompts, reward in zip(cfg.data.eval_sets, evals, self.rewards.eval, strict=True):
            encode, first = Prompts(self.chat, vision, prompts.base_dir), sum(len(h.episodes) for h in self.eval_sets)
            held = held_out(spec, prompts.head(spec.size), encode, self._fits, self.greedy, reward, first, cfg.run.seed)
            self.eval_sets.append(held)
        self.capacity = max(1, g.episodes_in_flight // g.n_samples)  # groups
        self.closed_at: int | None = None  # the serving version at which admission was last found closed
        self.groups: set[asyncio.Task] = set()
        self.journals: dict[int, GroupJournal] = {}  # of the groups being played, by seq
        self.evaluating: asyncio.Task | None = None
        self.failures = FailureWindow(ep.failure_window, ep.failure_limit)
        self.stats = EpisodeStats()
        self.changed = asyncio.Event()
        self.logged_causes: set[str] = set()
        self.crashed: BaseException | None = None  # a group's or evaluation's infrastructure error
        self.pushed = False  # any group yet (logged once)
        # a member from here, renewed from run(): set-up (user code slow to import) may outlive a lease
        self.lease, self.beat = control.join("generator", ident), {"version": 0, "pid": os.getpid()}  # last beat's
        self.keeper = LeaseKeeper(lambda: control.renew("generator", ident, self.lease, **self.beat))

    @property
    def version(self) -> int:
        """The weights version the engine serves."""
        return self.feed.version

    def _fits(self, prompt: Prompt) -> bool:
        return fits(len(prompt.learner_ids), self.cfg.generator.max_new_tokens, self.engine.max_model_len)

    # -- one episode, one group ------------------------------------------------------------------------
    async def play(
        self,
        record: dict,
        prompt: Prompt,
        seed: int,
        sampling: Sampling,
        reward=None,
        journal: GroupJournal | None = None,
        index: int = 0,
        shared: GroupTurns | None = None,
    ) -> tuple[Context, Outcome]:
        """One episode; with a group's ``journal``, it is kept there (and may be resumed from it), and
        with ``shared``, its first turn is one of the group's n-sample request."""
        ep = self.cfg.episode
        budget = self.engine.max_model_len - len(prompt.learner_ids)
        ctx = Context(
            task=record,
            seed=seed,
            prompt_ids=prompt.ids,
            complete=shared
            or (lambda ids, n: self.pump.complete(ids, dataclasses.replace(sampling, max_new_tokens=n), prompt.images)),
            chat=self.chat,
            stop=sampling.stop,
            budget=min(ep.max_tokens or budget, budget),
            max_new_tokens=sampling.max_new_tokens,
            cfg=ep,
            tools=self.tools,
            parser=self.parser,
            reward=reward or self.rewards.train[0],
            pool=self.pool,
        )
        if journal is None:
            return ctx, prompt.checked(ctx, await run_episode(self.episode, ctx, ep.episode_timeout_s))
        outcome = journal.attach(index, ctx)
        if outcome is None:
            outcome = prompt.checked(ctx, await run_episode(self.episode, ctx, ep.episode_timeout_s))
            journal.finished(index, ctx, outcome)
        return ctx, outcome

    async def run_group(self, seq: int, saved: dict[str, bytes] | None = None) -> None:
        """Group ``seq``: its episodes, from the beginning or (``saved``: a taken orphan's journal) from
        where the journal left them."""
        journal = self.journals[seq] = GroupJournal(self.buffer, seq, self.ident, saved)
        try:
            await self._run_group(seq, journal)
        finally:
            del self.journals[seq]

    async def _run_group(self, seq: int, journal: GroupJournal) -> None:
        version = self.version
        journal.claim()  # an orphan if this generator dies: played again on the same prompt, not skipped
        source, epoch, idx, record = self.train.record(seq)
        prompt = self.prompts[source](record)
        if not self._fits(prompt):  # never an engine error: skipped, counted, its slot given back
            self.stats.prompts_too_long += 1
            log.warning("a prompt leaves no room in the %d-token context: skipped", self.engine.max_model_len)
            await self._end_group(journal, release="abandoned")
            return
        n = self.cfg.generator.n_samples
        # the default single turn: the group's n completions of its prompt are one n-sample engine request
        shared = GroupTurns(self.pump, prompt, self.sampling, n) if self.episode is single_turn else None
        seeds = [episode_seed(self.cfg.run.seed, seq, i) for i in range(n)]
        try:
            played = await asyncio.gather(
                *(
                    self.play(record, prompt, s, self.sampling, self.rewards.train[source], journal, i, shared)
                    for i, s in enumerate(seeds)
                )
            )
        finally:
            if shared is not None:
                shared.cancel()
        if journal.saved:
            self.stats.groups_resumed += 1
            self.stats.turns_resumed += journal.resumed_turns
        for ctx, outcome in played:
            self.stats.episode(ctx, outcome)
            if outcome.cause is not None:
                self._log_failure(idx, outcome)
        self.failures.add_group([outcome for _, outcome in played])
        self.maybe_sample(version, prompt.ids, played)
        failed = sum(o.cause is not None for _, o in played)
        if failed and (self.cfg.episode.failure_policy == "drop_group" or failed == n):
            self.stats.groups_failed += 1
            await self._end_group(journal, release="failed")
            return
        samples = [to_sample(ctx, outcome) for ctx, outcome in played]
        self.stats.groups += 1
        group = prompt.group(samples, idx, epoch, self.ident)
        await self._end_group(journal, push=group)

    def _log_failure(self, idx: int, outcome: Outcome) -> None:
        """The first failure of each cause with its traceback; the rest only in the counters (a reward
        that raises on every third prompt must not bury the log)."""
        if outcome.cause in self.logged_causes:
            log.debug("episode of prompt %d failed: %s: %s", idx, outcome.cause, outcome.detail)
            return
        self.logged_causes.add(outcome.cause)
        log.warning(
            "episode of prompt %d failed: %s: %s (later %s failures are only counted)\n%s",
            idx, outcome.cause, outcome.detail, outcome.cause, outcome.traceback,
        )  # fmt: skip

    async def _end_group(
        self, journal: GroupJournal, *, push: TrajectoryGroup | None = None, release: str | None = None
    ) -> None:
        """Push the group or give its slot back (its journal ends with it); nothing if another generator
        took it over (this one stalled past its lease). On a thread: the event loop (and the engine pump
        on it) goes on meanwhile. Once started it runs to its end, cancelled or not: a push cut off
        after the server took it would leave a group both pushed and, at shutdown, given back."""
        seq = journal.seq if journal.kept or journal.saved or journal.claimed else None
        if journal.lost:
            return
        if push is not None:
            frame = encode_group(push)
            await _to_the_end(asyncio.to_thread(self.buffer.push, push.id, frame, producer=self.ident, seq=seq))
            if not self.pushed:  # a start-up phase (scripts/bench/startup.py)
                self.pushed = True
                log.info("generator %s pushed its first group", self.ident)
        else:
            await _to_the_end(asyncio.to_thread(self.buffer.release, 1, reason=release, producer=self.ident, seq=seq))
        self.changed.set()

    def maybe_sample(self, version: int, prompt: list[int], played: list) -> None:
        """A finished group of ``version``: its first episodes to samples.jsonl when it is the first group
        at or after a sample point (``evaluation.SAMPLE_EVERY``), once across the fleet."""
        reached = points_reached(self.due_samples, version)
        if not reached:
            return
        self.due_samples.difference_update(reached)
        if [p for p in reached if self.control.claim_once(f"samples:{p}")]:  # every one claimed, not the first
            items = sample_items(self.chat.tok, [prompt] * len(played), played, SAMPLE_ITEMS)
            self.metrics.log(samples_record("train", version, reached[-1], items))

    # -- phases ------------------------------------------------------------------------------------------
    def maybe_evaluate(self) -> None:
        """Evaluate the served version if it reached eval points (``evaluation``) no other generator claimed:
        the first version served at or after each, however many versions passed meanwhile."""
        if self.evaluating is not None or not any(h.episodes for h in self.eval_sets):
            return
        reached = points_reached(self.due_evals, self.version)
        if not reached:
            return
        self.due_evals.difference_update(reached)
        claimed = [p for p in reached if self.control.claim_once(f"eval:{p}")]  # each, not just the first
        if not claimed:
            return
        if passed := ", ".join(str(p) for p in claimed if p < self.version):
            log.info("eval point %s passed before version %d was served here: evaluating that", passed, self.version)
        self.evaluating = asyncio.create_task(self.evaluate(claimed))
        self.evaluating.add_done_callback(self._task_done)

    async def evaluate(self, points: list[int]) -> None:
        try:
            async with self.pump.hold():
                version, t0 = self.version, time.perf_counter()
                plays = [(h.reward, *e) for h in self.eval_sets for e in h.episodes]
                played = await asyncio.gather(*(self.play(r, p, s, how, fn) for fn, r, p, s, how in plays))
            record, point = eval_record(version, points, self.eval_sets, played, time.perf_counter() - t0), points[-1]
            if "eval/reward_mean" in record:
                log.info("eval at version %d (point %d): reward %.3f", version, point, record["eval/reward_mean"])
            else:
                log.warning("eval at version %d: every episode failed", version)
            self.metrics.log(record)
            self.control.set_meta(LAST_EVAL_FIELD, json.dumps(record))  # asyncrl status shows it
            items = eval_samples(self.chat.tok, self.eval_sets, played)
            self.metrics.log(samples_record("eval", version, point, items))
        finally:
            self.evaluating = None

    async def admit(self, orphans: bool = True) -> int:
        """Claim groups (:meth:`_claim`, on a thread: the event loop, and the engine pump's next step with it,
        never waits on Redis); each starts as its own task."""
        room = self.capacity - len(self.groups)
        if room <= 0 or self.version >= self.cfg.run.steps:  # full, or the learner is done (the final eval left)
            return 0
        if not orphans and self.closed_at == self.pump.next_version:  # closed: until a version or a tick (slots
            return 0  # the learner gives back, of filtered or stale groups); a Redis round trip a group's end saved
        claims = await asyncio.to_thread(self._claim, room, orphans)
        for seq, saved in claims:
            if saved is not None:  # a group of a generator that died: its slot is taken already
                log.info("resuming group %d of a generator that stopped (%d episodes journaled)", seq, len(saved))
            self._start(self.run_group(seq, saved))
        return len(claims)

    def _claim(self, room: int, orphans: bool) -> list[tuple[int, dict[str, bytes] | None]]:
        """Up to ``room`` groups: orphans first (``orphans``: look for them, at the tick's pace), then new ones
        under admission control keyed on the version their turns will be sampled with (``next_version``)."""
        claims = []
        while orphans and len(claims) < room and (orphan := self.buffer.take_orphan(self.ident)) is not None:
            claims.append(orphan)
        k, b = self.cfg.run.max_policy_lag, self.cfg.learner.groups_per_step
        serving = self.pump.next_version
        open_slots = admission_limit(serving, k, b) - live_groups(self.buffer.stats())
        started: list[tuple[int, None]] = []
        for _ in range(min(claim_share(open_slots, self.fleet, room, b), room - len(claims))):  # each claim atomic
            if (seq := self.buffer.try_start_group(serving, k, b, producer=self.ident)) is None:
                open_slots = len(started)  # the other generators took the rest
                break
            started.append((seq, None))
        self.closed_at = serving if len(started) >= open_slots else None
        return claims + started

    def _start(self, group) -> None:
        task = asyncio.create_task(group)
        self.groups.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        """Episodes fail as data; what escapes a group or an evaluation is an infrastructure error
        (Redis, the engine): it ends the loop, and the launcher restarts this generator."""
        self.groups.discard(task)
        if not task.cancelled() and task.exception() is not None and self.crashed is None:
            self.crashed = task.exception()
        self.changed.set()

    def report(self) -> None:
        record = self.stats.record(self.cfg.generator.n_samples * len(self.groups), self.pump.take_idle_fraction())
        record.update(self.pump.take_batch_stats())
        self.stats = EpisodeStats()
        record.update(self.rewards.metrics())  # a reward model's throughput
        threads, children = threads_and_children()  # bounded whatever user code does
        self.peaks["generator/threads_peak"] = max(self.peaks["generator/threads_peak"], threads)
        self.peaks["generator/child_processes_peak"] = max(self.peaks["generator/child_processes_peak"], children)
        record.update({"generator/threads": threads, "generator/child_processes": children, **self.peaks})
        if self.pool is not None:  # its replays and suspects (asyncrl.service.sessions)
            record.update({f"generator/pool_{k}": v for k, v in self.pool.stats().items()})
        self.metrics.log({"generator/version": self.version, **record})

    def _served(self, **fields) -> None:
        """The engine serves a new version: say so in the fleet, and admit at once (admission is keyed on
        the served version; the loop would otherwise wait for its next tick)."""
        self.heartbeat(**fields)
        self.changed.set()

    def heartbeat(self, **fields) -> None:
        """Renew this generator's lease in the fleet; a lost lease (it stalled past the lease's life and
        its slots were given back) ends the process before it can push groups it no longer holds."""
        self.beat = {"version": self.version, "pid": os.getpid(), **fields}  # the keeper's too
        self.keeper.tick()
        if self.keeper.lost or not self.control.renew("generator", self.ident, self.lease, **self.beat):
            raise LeaseLost(f"generator {self.ident} lost its lease (no heartbeat for {MEMBER_TTL_S:.0f}s)")

    def stop(self) -> None:
        """SIGTERM: finish the tick, give back the unpushed groups' slots and leave the fleet. A second
        one exits at once (Redis may be gone, and the leave with it: the lease then expires)."""
        if self.stopping:
            log.warning("generator %s: second SIGTERM, exiting now", self.ident)
            os._exit(143)
        self.stopping = True
        self.changed.set()

    # -- the loop ----------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Until the run stops, the launcher dies, failures pass the limit, or SIGTERM."""
        parent, pump = os.getppid(), asyncio.create_task(self.pump.run())
        self.keeper.start()  # renews the lease between ticks (generators.lease)
        last_report, last_tick = time.monotonic(), -TICK_S
        try:
            while not self.stopping and os.getppid() == parent:
                if pump.done():
                    break
                if self.crashed is not None:
                    raise self.crashed
                ticked = time.monotonic() - last_tick >= TICK_S
                if ticked:  # 0: the fleet, at the tick's pace only
                    last_tick = time.monotonic()
                    if self.control.stop_requested():
                        break
                    self.heartbeat()  # first: a generator without a lease must not claim or push
                    self.fleet = max(1, len(self.control.members("generator")))
                self.maybe_evaluate()  # 1
                await self.admit(orphans=ticked)  # 2: at once when a group ended
                if time.monotonic() - last_report >= REPORT_S:
                    self.report()
                    last_report = time.monotonic()
                if self.failures.exceeded:
                    self.fail_run()
                    break
                self.changed.clear()
                try:
                    await asyncio.wait_for(self.changed.wait(), max(0.0, last_tick + TICK_S - time.monotonic()))
                except TimeoutError:
                    pass
            if pump.done():
                pump.result()  # the engine failed: raise its error
        except LeaseLost:
            self.lease = None  # the reaper gave this generator's slots back already
            raise
        finally:
            self.keeper.close()
            await self.shutdown(pump)
            with contextlib.suppress(Exception):  # best effort: the run may be ending because Redis died
                self.report()  # the last interval's figures, the episodes just cancelled too
                if self.lease is not None:
                    self.control.leave("generator", self.ident, self.lease)

    def fail_run(self) -> None:
        message = f"generator {self.ident}: {self.failures.message()}"
        log.error("%s; stopping the run. The last failure:\n%s", message, self.failures.last_failure.traceback)
        self.control.set_meta("fatal", message)
        self.control.request_stop("failed")

    async def shutdown(self, pump: asyncio.Task) -> None:
        """Cancel every episode; the slots of their groups go back as ``abandoned``."""
        unfinished = [t for t in self.groups if not t.done()]
        leaving = not self.control.stop_requested()  # alone, while the run goes on: others resume its groups
        if leaving:
            for journal in self.journals.values():
                journal.hand_over()
        for task in [*unfinished, *([self.evaluating] if self.evaluating else [])]:
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
        if self.lease is not None:  # else the reaper took and gave back this generator's slots
            self.buffer.release_held(self.ident, resume=leaving)  # the unfinished groups'
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        if self.pool is not None:
            await self.pool.aclose()
        if (agents := sys.modules.get("asyncrl.gateway.server")) is not None:  # agent episodes ran
            await agents.close_endpoint()  # their OpenAI-compatible endpoint
        await self.rewards.aclose()  # a remote reward's connections


async def _to_the_end(call) -> None:
    """Await ``call``; if cancelled meanwhile, let it finish first, then raise the cancellation."""
    task = asyncio.ensure_future(call)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        raise
