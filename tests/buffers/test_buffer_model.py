"""Model-based test of the buffer's guarantees, on a real redis-server and on the memory buffer.

A hypothesis state machine drives a buffer (the real :class:`RedisBuffer` on a private redis-server
configured as the launcher's, by ``start_redis_server``: append-only file on) with the learner side,
:class:`BatchConsumer`, through random interleavings of: admissions and pushes from several
producers (duplicates and corrupt frames among them), abandoned groups, producers killed (their
held groups given back), learner steps on every
rank, checkpoint commits, learner crashes with a restart from the last committed checkpoint, and
SIGKILLs of redis-server (restarted on the same port and directory: the AOF is reloaded). A plain
in-memory model predicts every answer and counter. After every step it checks:

1. lag bound: a group in a batch taken at version ``v`` has ``0 <= v - group.version <= k``;
2. replay bound: no entry has more than ``R`` uses, and an entry is acknowledged ``trained`` only
   once every use of it is in the committed checkpoint (``1 <= uses <= R``);
3. nothing lost: ``lost_groups(stats) == 0`` and every counter and gauge equals the model's; after
   the final drain every group pushed is trained, stale, filtered or dead, as the model says;
4. admission: a request is granted exactly when the model's live count is under the limit, and the
   groups admitted and not given back never exceed the limit of the largest serving version passed;
5. dead letters: exactly one per corrupt frame consumed, with its producer, size, frame and reason.

The learner ranks' buffer handles are wrapped (:class:`Observed`), so each read, pending list and
acknowledgement the consumer makes is checked against the model as it happens: entries come in
append order, once each, and every acknowledgement has the outcome the model expects.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import uuid

import msgpack
import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from services import require_redis_binary

from asyncrl.buffers import Buffer, MemoryBuffer, run_prefix
from asyncrl.buffers.base import COUNTER_KEYS, OUTCOMES, DeadLetter, Entry, live_groups, lost_groups
from asyncrl.buffers.consumer import Batch, BatchConsumer, ConsumerRules, StopRequested
from asyncrl.buffers.redis_buffer import RedisBuffer
from asyncrl.fleet.redis_server import RedisServer, start_redis_server
from asyncrl.protocol import Sample, TrajectoryGroup, encode_group
from asyncrl.staleness import admission_limit

PRODUCERS = 3
# ConsumerRules.max_frame_bytes: small, so that an oversize frame is cheap to make.
MAX_FRAME_BYTES = 4096
# Two samples of 200 tokens, 12 bytes each (token id, log-prob, version), exceed MAX_FRAME_BYTES.
OVERSIZE_TOKENS = 200
# A SIGKILL and restart of redis-server costs ~70 ms, plus ~70 ms per MB of AOF it reloads: at most
# one per example, and an AOF rewritten (to almost nothing, between examples) once it passes 1 MiB,
# keep the test fast.
MAX_REDIS_RESTARTS = 1
AOF_REWRITE_BYTES = 1 << 20
# What the dead letter's reason says for each way a frame can be bad.
CORRUPTIONS = {
    "not_msgpack": "not msgpack",
    "schema_version": "unknown schema version",
    "shapes": "inconsistent sample shapes",
    "nan": "non-finite",
    "oversize": "exceeds",
}
KINDS = ("valid",) * 10 + tuple(CORRUPTIONS)  # two pushes in three are valid
HELD = ("read", "fresh", "batch", "pool", "done")  # where a rank holds a pending entry (Rec.held)

producer_ids = st.integers(0, PRODUCERS - 1)
group_specs = st.lists(
    st.tuples(st.sampled_from(KINDS), st.lists(st.sampled_from([0.0, 1.0]), min_size=2, max_size=3)),
    max_size=6,
)


# ----- frames ----------------------------------------------------------------------------------


def make_group(gid: str, producer: str, version: int, rewards, length: int = 2) -> TrajectoryGroup:
    samples = [
        Sample(
            np.arange(length, dtype=np.int32),
            np.full(length, -0.5, np.float32),
            np.full(length, version, np.int32),
            reward,
        )
        for reward in rewards
    ]
    prompt = np.array([1, 2], np.int32)
    return TrajectoryGroup(prompt, samples, prompt_index=0, epoch=0, producer=producer, id=gid, created_at=0.0)


def corrupt_frame(kind: str, gid: str, producer: str, version: int) -> bytes:
    """A frame a learner must dead-letter, bad in the way ``kind`` (a key of CORRUPTIONS) names."""
    if kind == "not_msgpack":
        return b"\xc1" + gid.encode()  # 0xc1 is never used by msgpack
    group = make_group(gid, producer, version, (0.0, 1.0), OVERSIZE_TOKENS if kind == "oversize" else 3)
    if kind == "shapes":
        group.samples[0].logprobs = group.samples[0].logprobs[:-1]
    elif kind == "nan":
        group.samples[-1].logprobs[1] = np.nan
    frame = encode_group(group)
    if kind == "schema_version":
        obj = msgpack.unpackb(frame, raw=False)
        obj["schema_version"] = 99
        frame = msgpack.packb(obj, use_bin_type=True)
    return frame


# ----- the model -------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Rec:
    """The model's view of one appended group."""

    seq: int  # append order
    gid: str
    frame: bytes
    producer: str
    version: int  # the version of every token: what its producer served when it was admitted
    zero_var: bool  # every sample has the same reward
    corrupt: str | None  # a key of CORRUPTIONS, or None for a valid frame
    state: str = "queued"  # queued, pending, or its outcome: trained, stale, filtered, dead
    rank: int | None = None  # the rank it was delivered to
    entry_id: str | None = None
    held: str | None = None  # while pending: one of HELD
    uses: int = 0  # optimizer steps that used it, committed or not
    committed: int = 0  # of which the last committed checkpoint holds


class Observed(Buffer):
    """One rank's handle on the buffer: each call the consumer makes is checked by the model.

    A consumer has no business admitting, pushing, releasing or publishing versions.
    """

    def __init__(self, inner: Buffer, model: BufferMachine, rank: int):
        self.inner, self.model, self.rank = inner, model, rank

    def read(self, consumer: str, count: int, block_ms: int) -> list[Entry]:
        entries = self.inner.read(consumer, count, block_ms)
        self.model.on_read(self.rank, consumer, count, entries)
        return entries

    def pending(self, consumer: str) -> list[Entry]:
        entries = self.inner.pending(consumer)
        self.model.on_pending(self.rank, consumer, [(e.entry_id, e.frame, e.producer) for e in entries])
        return entries

    def pending_ids(self, consumer: str) -> list[str]:
        ids = self.inner.pending_ids(consumer)
        self.model.on_pending(self.rank, consumer, ids, with_frames=False)
        return ids

    def ack(self, entries, outcome: str) -> int:
        n = self.inner.ack(entries, outcome)
        self.model.on_ack(self.rank, [e.entry_id for e in entries], outcome, n)
        return n

    def dead_letter(self, entry, reason: str):
        counter = self.inner.dead_letter(entry, reason)
        assert counter in (None, "dead"), "the model pushes every entry through push()"
        self.model.on_dead(self.rank, entry.entry_id, entry.frame, reason, entry.producer, counter is not None)
        return counter

    def record_replays(self, n: int, token: str | None = None) -> None:
        self.inner.record_replays(n, token)
        self.model.last_replays = n
        if token is None or token not in self.model.replay_tokens:  # a redone step's replays count once
            self.model.replay_tokens.add(token)
            self.model.counts["replayed"] += n

    def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        return self.inner.dead_letters(count)

    def get_version(self) -> int:
        return self.inner.get_version()

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def close(self) -> None:
        pass  # the machine closes the real buffer

    def try_start_group(self, *args, **kwargs):
        raise AssertionError("a consumer admitted a group")

    def push(self, *args, **kwargs):
        raise AssertionError("a consumer pushed")

    def release(self, *args, **kwargs):
        raise AssertionError("a consumer released slots")

    def release_held(self, *args, **kwargs):
        raise AssertionError("a consumer released a producer's slots")

    def journal(self, *args, **kwargs):
        raise AssertionError("a consumer journaled a group")

    def take_orphan(self, *args, **kwargs):
        raise AssertionError("a consumer took an orphan")

    def orphans(self) -> int:
        raise AssertionError("a consumer counted orphans")

    def set_version(self, v: int) -> None:
        raise AssertionError("a consumer published a version")


class BufferMachine(RuleBasedStateMachine):
    """Producers, learner ranks and failures against one buffer, checked against a model.

    ``server`` is a private redis-server shared by the examples of one test (each example has its
    own key prefix); None runs the same machine on :class:`MemoryBuffer`, without server restarts.
    """

    def __init__(self, server: RedisServer | None = None, admin: redis.Redis | None = None):
        super().__init__()
        self.server, self.admin = server, admin
        if server is None:
            self.buf: Buffer = MemoryBuffer()
        else:  # a short back-off: the server is back before the first retry
            self.buf = RedisBuffer(server.url, run_prefix(uuid.uuid4().hex), backoff_base_s=0.005)
        self.rules: ConsumerRules | None = None
        self.counts = dict.fromkeys(COUNTER_KEYS, 0)  # what the buffer's counters must say
        self.replay_tokens: set[str | None] = set()  # record_replays tokens seen (each counts once)
        self.last_replays = 0  # what the last take passed to record_replays
        self.recs: list[Rec] = []  # every group appended, in append order
        self.by_eid: dict[str, Rec] = {}
        self.queue: collections.deque[Rec] = collections.deque()  # appended, never delivered
        self.dead: list[Rec] = []  # in dead-letter order
        self.serving = [0] * PRODUCERS  # each producer's serving version
        # per producer, a slot for each group admitted and not pushed or released: the serving
        # version it was admitted at, which its tokens will have (it is generated with those weights)
        self.slots: list[collections.deque[int]] = [collections.deque() for _ in range(PRODUCERS)]
        self.max_serving = 0  # the largest serving version passed to try_start_group
        self.version = self.committed_version = 0
        self.consumers: list[BatchConsumer] = []
        self.committed_state: list[dict[str, int]] = []
        self.batches: dict[int, Batch] = {}  # ranks that took their batch while another waits
        self.final = False
        self.restarts = 0
        self.seen: set[str] = set()  # what happened in this example, reported as hypothesis events

    @initialize(
        k=st.integers(0, 2),
        replay_times=st.integers(1, 3),
        filter_zero_variance=st.booleans(),
        ranks=st.integers(1, 2),
        need=st.integers(1, 2),
    )
    def configure(self, k: int, replay_times: int, filter_zero_variance: bool, ranks: int, need: int) -> None:
        self.k, self.R, self.ranks, self.need = k, replay_times, ranks, need
        self.B = ranks * need  # groups per optimizer step, all ranks together
        self.rules = ConsumerRules(
            max_policy_lag=k,
            replay_times=replay_times,
            filter_zero_variance=filter_zero_variance,
            max_frame_bytes=MAX_FRAME_BYTES,
        )
        self.committed_state = [{} for _ in range(ranks)]
        self._new_consumers()

    def _new_consumers(self) -> None:
        self.consumers = [BatchConsumer(Observed(self.buf, self, r), f"rank{r}", self.rules) for r in range(self.ranks)]

    # ----- model helpers --------------------------------------------------------------------

    def _judge(self, rec: Rec) -> str | None:
        """The outcome a valid group must get at the current learner version, or None: usable."""
        if not 0 <= self.version - rec.version <= self.k:
            return "stale"
        if self.rules.filter_zero_variance and rec.zero_var:
            return "filtered"
        return None

    def _usable(self, rec: Rec) -> bool:
        return rec.corrupt is None and self._judge(rec) is None

    def _live(self) -> int:
        c = self.counts
        given_back = c["abandoned"] + c["dropped_stale"] + c["filtered"] + c["dead"]
        return c["started"] + c["replayed"] - given_back

    def _stats(self) -> dict[str, int]:
        """What :meth:`Buffer.stats` must say."""
        pending = sum(rec.state == "pending" for rec in self.recs)
        return {**self.counts, "queued": len(self.queue), "pending": pending, "foreign_in_buffer": 0}

    def _held_by(self, rank: int, *where: str) -> list[Rec]:
        return [r for r in self.recs if r.state == "pending" and r.rank == rank and r.held in where]

    # ----- checks of the consumer's buffer calls (from Observed) ----------------------------

    def on_read(self, rank: int, consumer: str, count: int, entries: list[Entry]) -> None:
        assert consumer == f"rank{rank}"
        assert len(entries) == min(count, len(self.queue)), f"read {len(entries)} of {len(self.queue)} queued"
        for entry in entries:
            rec = self.queue.popleft()
            assert (entry.frame, entry.producer) == (rec.frame, rec.producer), f"{rec.gid}: out of order or twice"
            rec.entry_id, rec.state, rec.rank, rec.held = entry.entry_id, "pending", rank, "read"
            self.by_eid[entry.entry_id] = rec

    def on_pending(self, rank: int, consumer: str, got: list, with_frames: bool = True) -> None:
        assert consumer == f"rank{rank}"
        mine = sorted(self._held_by(rank, *HELD), key=lambda r: r.seq)
        want = [(r.entry_id, r.frame, r.producer) if with_frames else r.entry_id for r in mine]
        assert got == want, f"rank{rank}'s pending entries differ from the model's"

    def on_ack(self, rank: int, entry_ids: list[str], outcome: str, n: int) -> None:
        for eid in entry_ids:
            rec = self.by_eid.get(eid)
            assert rec is not None and rec.rank == rank, f"rank{rank} acknowledged {eid}, not delivered to it"
            assert rec.state == "pending", f"{rec.gid} acknowledged twice ({rec.state}, then {outcome})"
            if outcome == "trained":
                assert rec.held == "done" or (self.final and rec.held == "pool"), f"{rec.gid} ({rec.held}) acked"
                assert 1 <= rec.committed == rec.uses <= self.R, (
                    f"{rec.gid}: uses {rec.uses}, {rec.committed} committed"
                )
            else:
                assert rec.corrupt is None and rec.uses == 0 and rec.held in ("read", "fresh"), rec
                assert self._judge(rec) == outcome, f"{rec.gid} acknowledged {outcome} at version {self.version}"
            rec.state, rec.held = outcome, None
            self.counts[OUTCOMES[outcome]] += 1
        assert n == len(entry_ids), f"ack counted {n} of {len(entry_ids)}"

    def on_dead(self, rank: int, eid: str, frame: bytes, reason: str, producer: str, ok: bool) -> None:
        rec = self.by_eid[eid]
        assert ok and rec.rank == rank and rec.state == "pending" and rec.held == "read", rec
        assert rec.corrupt is not None, f"valid group {rec.gid} dead-lettered: {reason}"
        assert (frame, producer) == (rec.frame, rec.producer)
        assert CORRUPTIONS[rec.corrupt] in reason, f"{rec.corrupt}: reason {reason!r}"
        rec.state, rec.held = "dead", None
        self.counts["dead"] += 1
        self.dead.append(rec)

    # ----- producers ------------------------------------------------------------------------

    @rule(
        i=producer_ids,
        sync=st.booleans(),
        admit=st.integers(0, 6),
        specs=group_specs,
        abandon=st.integers(0, 2),
        resend=st.lists(st.tuples(st.integers(0, 1 << 16), st.booleans()), max_size=2),
    )
    def generate(self, i: int, sync: bool, admit: int, specs: list, abandon: int, resend: list) -> None:
        """Producer ``i`` (``sync``: after loading the learner's current weights) asks admission for
        ``admit`` groups at its serving version; pushes as many groups as ``specs`` lists, valid or
        corrupt, oldest slot first, if it holds that many; abandons up to ``abandon`` slots it still
        holds (the rest stay in flight); and pushes again group ids pushed before (``resend``: which
        one, and whether the same frame, as a retry, or another one), which must append nothing."""
        if sync:
            self.serving[i] = self.version
        self._admit(i, admit)
        for kind, rewards in specs[: len(self.slots[i])]:
            self._push_one(i, kind, rewards)
        n = min(abandon, len(self.slots[i]))
        self.buf.release(n, producer=f"gen-{i}")
        self.counts["abandoned"] += n
        for _ in range(n):
            self.slots[i].popleft()
        for which, retry in resend if self.recs else ():
            rec = self.recs[which % len(self.recs)]
            assert self.buf.push(rec.gid, rec.frame if retry else b"another frame", producer=f"gen-{i}") is False
            self.counts["duplicates"] += 1

    def _admit(self, i: int, n: int) -> None:
        sv = self.serving[i]
        self.max_serving = max(self.max_serving, sv)
        limit = admission_limit(sv, self.k, self.B)
        for _ in range(n):
            want = self._live() < limit
            seq = self.buf.try_start_group(sv, self.k, self.B, producer=f"gen-{i}")
            assert seq == (self.counts["started"] if want else None), f"live {self._live()}, limit {limit}"
            self.counts["started"] += want
            if want:
                self.slots[i].append(sv)

    def _push_one(self, i: int, kind: str, rewards: list[float]) -> None:
        gid, producer, version = f"g{len(self.recs)}", f"gen-{i}", self.slots[i].popleft()
        if kind == "valid":
            frame, corrupt = encode_group(make_group(gid, producer, version, rewards)), None
        else:
            frame, corrupt = corrupt_frame(kind, gid, producer, version), kind
        assert self.buf.push(gid, frame, producer=producer) is True
        self.recs.append(Rec(len(self.recs), gid, frame, producer, version, len(set(rewards)) == 1, corrupt))
        self.queue.append(self.recs[-1])
        self.counts["pushed"] += 1

    @rule(i=producer_ids)
    def producer_dies(self, i: int) -> None:
        """Producer ``i`` is killed: what the buffer gives back for it is exactly the groups it
        admitted and neither pushed nor released; the others' stay held."""
        n = self.buf.release_held(f"gen-{i}")
        assert n == len(self.slots[i]), f"gen-{i} held {len(self.slots[i])}, {n} given back"
        self.counts["abandoned"] += n
        self.slots[i].clear()

    # ----- learner ----------------------------------------------------------------------------

    @precondition(lambda self: self.recs)
    @rule(steps=st.integers(1, 3))
    def learner_steps(self, steps: int) -> None:
        """Up to ``steps`` optimizer steps, as long as every rank gets its batch."""
        for _ in range(steps):
            if not self._learner_step():
                return

    def _learner_step(self) -> bool:
        """Every rank takes its batch; once all have one, all train and the version advances."""
        for r in range(self.ranks):
            if r not in self.batches:
                batch = self._take(r, self.need)
                if batch is not None:
                    self.batches[r] = batch
        if len(self.batches) < self.ranks:
            return False  # a rank waits for groups; the others keep their batches for this step
        for r, batch in sorted(self.batches.items()):
            self._trained(r, batch)
        self.batches.clear()
        self.version += 1
        self.buf.set_version(self.version)
        self.seen.add(f"learner reached version {min(self.version, 3)}{'+' if self.version >= 3 else ''}")
        return True

    def _take(self, r: int, need: int) -> Batch | None:
        """Rank ``r`` takes ``need`` groups, checked; None if it stopped for want of groups."""
        for rec in self._held_by(r, "pool"):  # replays gone stale are done: trained already
            if self._judge(rec) is not None:
                rec.held = "done"
        held = sum(map(self._usable, self._held_by(r, "fresh", "pool")))
        expect = held + sum(map(self._usable, self.queue)) >= need
        self.last_replays = 0
        try:  # the queue is empty exactly when a blocking read would find nothing
            batch = self.consumers[r].take(need, self.version, block_ms=1, stop=lambda: not self.queue)
        except StopRequested:
            batch = None
        if batch is not None:
            self._check_batch(r, need, batch, self.last_replays)
        self._settle_reads(r)
        assert (batch is not None) == expect, f"rank{r} had {held} usable + {len(self.queue)} queued, needs {need}"
        assert batch is not None or not self.queue, "stopped with groups in the buffer"
        return batch

    def _check_batch(self, r: int, need: int, batch: Batch, replays_recorded: int) -> None:
        recs = [self.by_eid[h.entry_id] for h in batch.items]
        assert len(recs) == len(set(map(id, recs))) == need
        for h, rec in zip(batch.items, recs, strict=True):
            assert rec.state == "pending" and rec.rank == r and rec.held in ("read", "fresh", "pool"), rec
            assert (h.group.id, h.uses) == (rec.gid, rec.uses)
            assert 0 <= self.version - h.group.version <= self.k, f"lag bound: {rec.gid} at {self.version}"
            assert self._usable(rec) and rec.uses < self.R, rec
        replays = [rec for rec in recs if rec.uses]
        assert batch.replays == len(replays) == replays_recorded
        unused = [rec for rec in self._held_by(r, "read") if rec not in recs and self._usable(rec)]
        assert not unused, f"rank{r} read usable groups it did not take: {[u.gid for u in unused]}"
        if replays:
            fresh = [rec.gid for rec in self._held_by(r, "fresh") if rec not in recs]
            assert not fresh, f"rank{r} took replays while it held new groups {fresh}"
            spare = [rec.uses for rec in self._held_by(r, "pool") if rec not in recs]
            assert not spare or max(rec.uses for rec in replays) <= min(spare), "replays with fewest uses first"
        for rec in recs:
            rec.held = "batch"

    def _settle_reads(self, r: int) -> None:
        """After a take or recover: what rank ``r`` read and did not acknowledge is held, usable."""
        for rec in self._held_by(r, "read", "fresh"):
            assert self._usable(rec), f"rank{r} holds {rec.gid}, due {rec.corrupt or self._judge(rec)}"
            rec.held = "fresh"

    def _trained(self, r: int, batch: Batch) -> None:
        self.consumers[r].trained(batch)
        for h in batch.items:
            rec = self.by_eid[h.entry_id]
            rec.uses += 1
            rec.held = "done" if rec.uses >= self.R else "pool"

    def _uncommitted(self) -> bool:
        """Whether a commit now would change anything."""
        changed = (rec.uses != rec.committed or rec.held == "done" for rec in self.recs if rec.state == "pending")
        return self.version != self.committed_version or any(changed)

    def _checkpoint(self) -> None:
        """Every rank's state goes into the checkpoint, which is committed."""
        for r, consumer in enumerate(self.consumers):
            state = consumer.checkpoint_state()
            assert state == {rec.entry_id: rec.uses for rec in self._held_by(r, "pool", "done")}
            for rec in self._held_by(r, *HELD):
                rec.committed = rec.uses
            self.committed_state[r] = state
        self.committed_version = self.version

    @precondition(lambda self: not self.batches and self._uncommitted())
    @rule()
    def commit(self) -> None:
        """A checkpoint between steps is committed; then each rank acknowledges what is done."""
        self._checkpoint()
        for r, consumer in enumerate(self.consumers):
            done = len(self._held_by(r, "done"))
            assert consumer.commit() == done

    @precondition(lambda self: any(rec.state == "pending" for rec in self.recs))
    @rule(after_checkpoint=st.booleans(), clamp=st.booleans())
    def learner_crash(self, after_checkpoint: bool, clamp: bool) -> None:
        """Every rank dies (``after_checkpoint``: once a checkpoint is committed, before it
        acknowledges) and restarts from the committed checkpoint; uncommitted uses are lost.
        ``clamp``: producers go back to the restored version; else they serve discarded ones."""
        if after_checkpoint and not self.batches:
            self._checkpoint()
        self.batches.clear()
        self.version = self.committed_version
        self.buf.set_version(self.version)
        if clamp:
            self.serving = [min(v, self.version) for v in self.serving]
        expected = [self._expect_recover(r) for r in range(self.ranks)]
        self._new_consumers()
        self.seen.update(f"recover: {k}" for e in expected for k, n in e.items() if n)
        for r, consumer in enumerate(self.consumers):
            assert consumer.recover(self.version, dict(self.committed_state[r])) == expected[r]
            self._settle_reads(r)
            assert not self._held_by(r, "done"), "recover left trained entries unacknowledged"

    def _expect_recover(self, r: int) -> dict[str, int]:
        counts = dict.fromkeys(("foreign", "dead", "stale", "filtered", "trained", "replay", "fresh"), 0)
        for rec in self._held_by(r, *HELD):
            rec.uses = rec.committed
            if rec.uses == 0:
                rec.held = "read"  # judged again, as if just read
                counts[self._judge(rec) or "fresh"] += 1
            elif rec.uses >= self.R or self._judge(rec) is not None:
                rec.held = "done"
                counts["trained"] += 1
            else:
                rec.held = "pool"
                counts["replay"] += 1
        return counts

    # ----- redis-server -----------------------------------------------------------------------

    @precondition(lambda self: self.server is not None and self.recs and self.restarts < MAX_REDIS_RESTARTS)
    @rule()
    def redis_restart(self) -> None:
        """SIGKILL (no flush), then start on the same port and directory: the AOF is reloaded and
        must hold every write the server acknowledged (the client reconnects by itself)."""
        self.server.kill()
        self.server.start()
        self.restarts += 1
        self.seen.add("redis-server killed and restarted")
        try:
            s = self.buf.stats()
        except redis.ResponseError as exc:  # NOGROUP: even the stream is gone
            raise AssertionError(f"redis-server lost acknowledged writes across a SIGKILL: {exc}") from None
        want = self._stats()
        assert s == want, f"redis-server lost acknowledged writes across a SIGKILL: {s} != {want}"

    # ----- invariants -------------------------------------------------------------------------

    @invariant()
    def guarantees_hold(self) -> None:
        if self.rules is None:
            return
        s = self.buf.stats()
        assert s == self._stats()
        assert lost_groups(s) == 0
        assert live_groups(s) == self._live()
        admitted = s["started"] - s["abandoned"] - s["dropped_stale"] - s["filtered"] - s["dead"]
        assert admitted <= admission_limit(self.max_serving, self.k, self.B)
        assert all(0 <= rec.committed <= rec.uses <= self.R for rec in self.recs)
        assert self.buf.get_version() == self.version
        letters = self.buf.dead_letters(1000)
        assert [(d.producer, d.size, d.frame) for d in letters] == [
            (r.producer, len(r.frame), r.frame) for r in self.dead
        ]
        assert all(CORRUPTIONS[r.corrupt] in d.reason for d, r in zip(letters, self.dead, strict=True))
        for r, consumer in enumerate(self.consumers):  # the rank holds what the model says
            assert set(consumer.pool) == {rec.entry_id for rec in self._held_by(r, "pool")}
            assert set(consumer.done) == {rec.entry_id for rec in self._held_by(r, "done")}
            assert {h.entry_id for h in consumer.fresh} == {rec.entry_id for rec in self._held_by(r, "fresh")}

    def teardown(self) -> None:
        try:
            # sys.exc_info(): teardown runs in hypothesis' `finally`; after a failure, only clean up
            if self.rules is not None and sys.exc_info()[0] is None:
                self._drain()
        finally:
            self.buf.close()
            if self.admin is not None:  # the server is this test's own: empty it, keep its AOF small
                self.admin.flushdb()
                aof = self.admin.info("persistence")
                if aof["aof_current_size"] > AOF_REWRITE_BYTES and not aof["aof_rewrite_in_progress"]:
                    self.admin.bgrewriteaof()

    def _drain(self) -> None:
        """The run ends: ranks finish their steps and use up what they hold, one group per step
        (the version stays), then the final commit; every producer's held groups are given back.
        Every group appended must then have its one outcome, and the counters the model's."""
        for r, batch in sorted(self.batches.items()):
            self._trained(r, batch)
        self.batches.clear()
        for r in range(self.ranks):
            while (batch := self._take(r, 1)) is not None:
                self._trained(r, batch)
        self.final = True
        self._checkpoint()
        for r, consumer in enumerate(self.consumers):
            trained = len(self._held_by(r, "pool", "done"))
            assert consumer.commit(final=True) == trained
        held = sum(len(slots) for slots in self.slots)  # the producers stop (as on a resume)
        assert self.buf.release_held() == held
        self.counts["abandoned"] += held
        for slots in self.slots:
            slots.clear()
        self.guarantees_hold()
        s = self.buf.stats()
        assert s["queued"] == s["pending"] == 0
        outcomes = dict(collections.Counter(rec.state for rec in self.recs))
        assert outcomes == {state: s[c] for state, c in {**OUTCOMES, "dead": "dead"}.items() if s[c]}
        for rec in self.recs:
            assert (rec.state == "dead") == (rec.corrupt is not None), rec
            assert rec.state != "trained" or 1 <= rec.committed <= self.R, rec
        self.seen.update(f"some groups {outcome}" for outcome in outcomes)
        self.seen.update(f"{c} > 0" for c in ("replayed", "duplicates", "abandoned") if s[c])
        for name in sorted(self.seen):
            event(name)


SETTINGS = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@pytest.mark.slow
@pytest.mark.redis
def test_buffer_guarantees_on_redis_with_crashes(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One private server (configured as the launcher's) for all examples; each has its own prefix."""
    require_redis_binary()
    server = start_redis_server(tmp_path_factory.mktemp("redis-model"), appendonly=True)
    admin = redis.Redis.from_url(server.url)
    try:
        run_state_machine_as_test(lambda: BufferMachine(server, admin), settings=SETTINGS)
    finally:
        admin.close()
        server.stop()


@pytest.mark.slow
def test_buffer_guarantees_in_memory() -> None:
    run_state_machine_as_test(BufferMachine, settings=settings(SETTINGS, max_examples=100))


# As hypothesis marks its own stateful TestCase.runTest: pytest then reports these tests'
# statistics (--hypothesis-show-statistics: examples run, events). Neither uses a function-scoped
# fixture, which examples would share.
test_buffer_guarantees_on_redis_with_crashes.is_hypothesis_test = True
test_buffer_guarantees_in_memory.is_hypothesis_test = True
