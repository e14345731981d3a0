"""One learner rank: the loop that turns buffered trajectory groups into policy versions.

All ranks step in lockstep (the gradient all-reduce is a barrier). Each step, at version v:
  1. collect  - B / L groups for this rank through its BatchConsumer (``buffers/consumer.py``):
                stale, filtered and undecodable groups are acknowledged with that outcome and do
                not count; replays fill in when the buffer has too few new groups
  2. loss     - the preset's pieces (``objective``): advantages, off-policy correction,
                policy / KL / value losses, normalised by global counts so the split across ranks
                does not matter
  3. step     - DeepSpeed backward + optimizer step (and the critic's, if any), once per mini-batch
                (``learner.minibatches`` x ``learner.epochs``): version v + 1 after the batch
  4. publish  - rank 0 sets the buffer's version and publishes the weights over the weight bus
  5. commit   - every ``learner.checkpoint_every`` versions: a checkpoint, committed, and only then
                the groups it trained are acknowledged in the buffer (the step's metrics record goes
                out before it, so every committed version is in the history a resumed run continues)

A stop (the launcher's, e.g. on Ctrl-C) is seen while collecting: every rank stops at the same version
(``take_unless_stopping``) and commits a checkpoint of what it trained since the last one, so a resumed
run goes on from there instead of redoing those steps.

On start a rank restores the committed checkpoint if there is one (a restart after a crash) and
takes back the entries it had pending, judged again at the restored version.

:func:`run` reads as the rank's phases in order: ``set_up`` (tokenizer, models, consumer), ``restore``,
``publish_start`` (the weight bus and the first version), ``train_steps`` (``advance``: steps 1-5 above,
once a version) and ``finish`` (final checkpoint, export and commit; rank 0 waits for a generator to
serve the last version). The model step itself is ``train_step``'s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from asyncrl import buffers
from asyncrl.buffers.base import Buffer
from asyncrl.buffers.consumer import Batch, BatchConsumer, ConsumerRules, StopRequested
from asyncrl.chat import ChatTokens
from asyncrl.config import Config, load_config
from asyncrl.control import RunControl, connect
from asyncrl.data.sources import PromptSet
from asyncrl.keys import starting_field
from asyncrl.learners.batching import make_batch
from asyncrl.learners.deepspeed_engine import (
    commit_due,
    export_hf,
    full_state_dict,
    hide_triton_without_cuda,
    init_distributed,
    load_committed,
    save_checkpoint,
)
from asyncrl.learners.lora import base_model
from asyncrl.learners.objective import DistReducer
from asyncrl.learners.records import step_record, step_sums
from asyncrl.learners.train_step import Models, ScoredSampling, build_models, probe_of, train_step
from asyncrl.learners.vision import BatchImages, batch_images, published_names
from asyncrl.lifetime import exit_after_collectives, starting_up
from asyncrl.observe import probe
from asyncrl.observe.metrics import RedisSink, Timings, setup_logging
from asyncrl.secret import read_secret
from asyncrl.staleness import staleness
from asyncrl.weights import bus_address, setup_publisher
from asyncrl.weights.ties import module_aliases

if TYPE_CHECKING:
    from asyncrl.weights.base import WeightPublisher

log = logging.getLogger("asyncrl.learner")


def start_phase(control: RunControl, rank: int) -> Callable[[str], None]:
    """``phase(what)``: what this rank waits for while it starts, in its log and in the run's metadata (until it
    is up: :func:`run`), where the launcher reads it about a rank that is not up in time (``asyncrl.keys``)."""
    field = starting_field("learner", rank)

    def phase(what: str) -> None:
        log.info("start-up: %s", what)
        control.set_meta(field, json.dumps({"what": what, "since": time.time()}))

    return phase


@dataclass
class LearnerRank:
    """What a learner rank sets up once (:func:`set_up`) and every later phase of :func:`run` uses."""

    cfg: Config
    control: RunControl
    buffer: Buffer
    rank: int
    world: int
    models: Models
    keep: set[str] | None  # the names each version carries: a VLM's language model alone, its vision frozen
    sampling: ScoredSampling
    metrics: RedisSink
    reducer: DistReducer
    consumer: BatchConsumer
    pad_id: int
    images: BatchImages | None  # a vision-language policy's pixel inputs
    probe_seq: list[int]  # the weight-sync probe's ids (asyncrl.observe.probe)
    publisher: WeightPublisher | None = None  # rank 0's weight bus, from :func:`publish_start` on

    @property
    def need(self) -> int:
        """Groups this rank trains each step."""
        return self.cfg.learner.groups_per_step // self.world

    @property
    def ckpt_dir(self) -> Path:
        return self.cfg.run_dir / "checkpoint"

    @property
    def probing(self) -> bool:
        """Whether this rank runs the probe's forward: a collective under ZeRO-3 (every rank); otherwise rank 0,
        which publishes, alone."""
        return self.publisher is not None or self.cfg.learner.zero_stage == 3


def run(cfg: Config, control: RunControl, buffer: Buffer, rank: int, world: int, phase=lambda what: None) -> None:
    """The learner rank's loop (the module doc's phases), from its restored version to ``run.steps``: set up,
    restore, publish the starting version, the steps, the end."""
    with starting_up():  # the collector's passes left for the end of set-up (asyncrl.lifetime)
        r = set_up(cfg, control, buffer, rank, world, phase)
        phase("restoring the committed checkpoint, if any")
        start = restore(r.models, r.consumer, r.ckpt_dir, rank)
        state = publish_start(r, start)
    control.forget_meta(starting_field("learner", rank))
    log.info("rank %d ready at version %d", rank, start)  # a start-up phase (scripts/bench/startup.py)
    state = train_steps(r, start, state)
    finish(r, state)


def set_up(
    cfg: Config, control: RunControl, buffer: Buffer, rank: int, world: int, phase: Callable[[str], None]
) -> LearnerRank:
    """Start-up: the generators' encoding (the probe's ids, the pad id), the models in DeepSpeed, this rank's
    consumer of the buffer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    ep = cfg.episode
    chat = ChatTokens(tokenizer, use_template=ep.chat_template, system_prompt=ep.system_prompt)  # the generators'
    images = batch_images(cfg.model.path)
    probe_seq = probe.probe_ids(chat, PromptSet(cfg.data.train_sources[0])[0], images.vision if images else None)
    phase("loading the model into DeepSpeed")
    models = build_models(cfg.learner, cfg.model, cfg.algorithm, cfg.run.steps)
    keep = published_names(models.policy, cfg.model)
    sampling = ScoredSampling(cfg.generator.temperature, cfg.generator.max_new_tokens)
    metrics, reducer = RedisSink(control, f"learner/{rank}"), DistReducer()
    rules = ConsumerRules(
        max_policy_lag=cfg.run.max_policy_lag,
        replay_times=cfg.buffer.replay_times,
        filter_zero_variance=cfg.buffer.filter_zero_variance or cfg.algorithm.preset.dynamic_filtering,
        max_frame_bytes=int(cfg.buffer.max_frame_mb * (1 << 20)),
    )
    consumer = BatchConsumer(buffer, f"rank{rank}", rules)
    return LearnerRank(
        cfg,
        control,
        buffer,
        rank,
        world,
        models,
        keep,
        sampling,
        metrics,
        reducer,
        consumer,
        pad_id=tokenizer.pad_token_id,
        images=images,
        probe_seq=probe_seq,
    )


def restore(models: Models, consumer: BatchConsumer, ckpt_dir: Path, rank: int) -> int:
    """Resume from the committed checkpoint (policy and critic), if any; take back this rank's pending
    entries. Returns the version to continue from (0 on a fresh start)."""
    restored = load_committed(models.policy, ckpt_dir, critic=models.critic)
    version, uses = restored if restored is not None else (0, {})
    counts = consumer.recover(version, uses)
    if restored is not None or any(counts.values()):
        log.info("rank %d resumes at version %d; pending entries taken back: %s", rank, version, counts)
    return version


def publish_start(r: LearnerRank, start: int) -> dict | None:
    """Rank 0 starts the weight bus and publishes version ``start``, the generators' first; every rank takes
    part in the collectives. Returns the state dict published (rank 0's; None elsewhere)."""
    if r.rank == 0:
        log.info("algorithm %s: %s", r.cfg.algorithm.name, r.cfg.algorithm.preset)
        r.publisher = start_publisher(r.cfg)
    probed, state = gather_version(r)
    if r.publisher is not None:
        # before any generator applies; a LoRA policy's names are its HF model's
        r.control.set_meta("tied", json.dumps(module_aliases(base_model(r.models.policy.module))))
        publish_version(r, start, probed, state)
        r.control.set_meta("weights_address", r.publisher.address)
    return state


def train_steps(r: LearnerRank, start: int, state: dict | None) -> dict | None:
    """The steps from version ``start`` to ``run.steps``, one each (:func:`advance`). Returns the state dict last
    published (``state``, that of ``start``, if none is left to take), which the end exports."""
    t_start = time.time()
    timings = Timings()
    committed = start  # the version of the last committed checkpoint (or commit without one)
    for version in range(start, r.cfg.run.steps):
        state, did_commit = advance(r, version, committed, timings, t_start)
        if did_commit:
            committed = version + 1
    return state


def advance(r: LearnerRank, version: int, committed: int, timings: Timings, t_start: float) -> tuple[dict | None, bool]:
    """The step from ``version`` to ``version + 1``, phases 1-5 of the module doc (``committed``: the version of
    the last commit, from which a stop commits). Returns the state dict published (rank 0's; None elsewhere)
    and whether the step committed."""
    cfg, control, consumer, preset = r.cfg, r.control, r.consumer, r.cfg.algorithm.preset
    timings.reset()
    # 1. collect; a stop (Ctrl-C) commits what was trained since the last checkpoint
    batch = take_unless_stopping(consumer, r.need, version, cfg.buffer.block_ms, control, r.reducer)
    if batch is None:
        stop_at(cfg, r.models, consumer, version, committed)
    groups = batch.groups
    stale = [staleness(version, g.version) for g in groups]
    timings.time("collect")
    # 2-3. loss and step
    # the next version's probe: a sequence of this batch (a VLM's: the fixed one), scored before the step too,
    # and before the batch is made (a VLM's batch sets the pixel inputs of the next forward: the training one)
    ids = (r.images is None and probe.sampled_ids(groups)) or r.probe_seq
    previous = probe_of(r.models, ids)[0] if r.probing else None
    padded = make_batch(groups, r.sampling.max_len, preset, r.pad_id, version, r.images)
    out, mismatch = train_step(r.models, padded, preset, cfg.learner, r.sampling, r.world)
    step_end_at = time.time()
    consumer.trained(batch)
    log.info("step %d trained %s", version + 1, " ".join(g.id for g in groups))  # lineage (scripts/chaos.py)
    control.count_staleness(stale)
    timings.time("train")
    # 4. publish (the probe first: a generator applying the version finds it)
    probed, state = gather_version(r, ids)
    if r.publisher is not None:
        publish_version(r, version + 1, probed, state, ids, previous)
    timings.time("publish")
    # metrics, global over ranks, before the commit: a committed version always has its record
    total = r.reducer.sum_dict(step_sums(groups, batch, stale, mismatch))
    (max_stale,) = r.reducer.max([max(stale)])
    if r.rank == 0:
        lr = r.models.policy.get_lr()[0]
        record = step_record(version + 1, out, total, max_stale, lr, probe.read_health(control))
        record.update(timings.record())
        record["learner/wall_seconds"] = time.time() - t_start
        r.metrics.log({**record, "time/step_end_at": step_end_at})
    # 5. commit
    committed_now = commit_step(cfg, r.models, consumer, version + 1, r.metrics if r.rank == 0 else None)
    control.heartbeat("learner", str(r.rank), version=version + 1, pid=os.getpid())
    return state, committed_now


def gather_version(r: LearnerRank, ids: list[int] | None = None) -> tuple[tuple | None, dict | None]:
    """The version the policy holds now: the probe's log-probs and expert choices (where this rank probes; of
    ``ids``, else the fixed probe) and the state dict (rank 0's; None elsewhere). Collectives under ZeRO-3:
    every rank calls it."""
    probed = probe_of(r.models, r.probe_seq if ids is None else ids) if r.probing else None
    return probed, full_state_dict(r.models.policy, r.cfg.learner.zero_stage, r.keep)


def publish_version(
    r: LearnerRank,
    version: int,
    probed: tuple,
    state: dict | None,
    ids: list[int] | None = None,
    previous: list[float] | None = None,
) -> None:
    """Rank 0 publishes ``version``: the probe first (a generator applying the version finds it; ``ids``: the
    sequence it is of where not the fixed probe, ``previous``: its log-probs under the version before), then
    the buffer's version and the weights."""
    logprobs, routing = probed
    probe.publish(r.control, version, logprobs, routing, ids=ids, previous=previous)
    r.buffer.set_version(version)
    r.publisher.publish(version, state)


def finish(r: LearnerRank, state: dict | None) -> None:
    """The end, after the last step: a final checkpoint and HF export (``learner.checkpoint``), the final
    commit, and rank 0's publisher kept until a generator serves the final version (it runs the final
    evaluation). ``state``: the final version's state dict (rank 0's)."""
    cfg, engine, steps = r.cfg, r.models.policy, r.cfg.run.steps
    if r.rank == 0:
        r.control.set_meta("final_version", steps)
    if cfg.learner.checkpoint:
        save_checkpoint(engine, r.ckpt_dir, steps, r.consumer.checkpoint_state(), critic=r.models.critic)
        whole = state if r.keep is None else full_state_dict(engine, cfg.learner.zero_stage)  # the frozen tower too
        export_hf(engine, cfg.model.path, cfg.run_dir / "export", whole, cfg.model.lora)
        log.info("rank %d: final checkpoint and export written", r.rank)
    r.consumer.commit(final=True)
    if r.publisher is not None:
        wait_for_generators(r.control, steps, timeout_s=120)
        r.publisher.close()
        log.info("rank 0: a generator serves version %d; publisher closed", steps)


def take_unless_stopping(
    consumer: BatchConsumer, need: int, version: int, block_ms: int, control: RunControl, reducer: DistReducer
) -> Batch | None:
    """This rank's batch for ``version``, or None on every rank when the run is stopping: a rank that saw
    the stop while waiting ends the others too, their batches held again (a collective: every rank calls
    it once a step; the ranks then stop at the same version, and a checkpoint there is a collective too)."""
    try:
        batch = consumer.take(need, version, block_ms, stop=control.stop_requested)
    except StopRequested:
        batch = None
    (stopping,) = reducer.max([float(batch is None)])
    if stopping and batch is not None:
        consumer.give_back(batch)
        return None
    return batch


def commit_step(cfg: Config, models: Models, consumer: BatchConsumer, version: int, metrics: RedisSink | None) -> bool:
    """Commit after the step that made ``version`` where one is due (``metrics``: rank 0's, for the commit's
    record). Returns whether it committed."""
    if commit_due(cfg.learner, version, cfg.run.steps):
        timings = Timings()  # the step's phases are logged: the commit is timed on its own
        commit_checkpoint(cfg, models, consumer, version)
        timings.time("commit")
        if metrics is not None:
            metrics.log({"checkpoint/version": version, "checkpoint/seconds": timings.seconds["commit"]})
        return True
    if cfg.learner.checkpoint_every == 0 and not cfg.learner.checkpoint:
        consumer.commit()  # nothing to resume from: a step is the only commit point there is
        return True
    return False


def commit_checkpoint(cfg: Config, models: Models, consumer: BatchConsumer, version: int) -> None:
    """Save every rank's part of ``version`` (policy and critic), commit it, acknowledge what it trained."""
    save_checkpoint(models.policy, cfg.run_dir / "checkpoint", version, consumer.checkpoint_state(), models.critic)
    consumer.commit()


def stop_at(cfg: Config, models: Models, consumer: BatchConsumer, version: int, committed: int) -> NoReturn:
    """The run stops at ``version``: first a checkpoint of what was trained since the last commit (at
    ``committed``), committed, where the run keeps checkpoints at all (a collective: every rank stops at
    the same version)."""
    if version > committed and (cfg.learner.checkpoint or cfg.learner.checkpoint_every > 0):
        commit_checkpoint(cfg, models, consumer, version)
        log.info("rank %d: the run stops; checkpoint of version %d committed", dist.get_rank(), version)
    raise StopRequested(f"stop requested at version {version}")


def start_publisher(cfg: Config):
    """Rank 0's weight bus: private on one host, authenticated with the run's secret for other hosts."""
    return setup_publisher(cfg.weights, bus_address(cfg.weights, cfg.run.host, cfg.run_dir), secret=read_secret())


def wait_for_generators(control: RunControl, version: int, timeout_s: float) -> None:
    """Keep the publisher alive until some generator serves ``version`` (or the launcher stops us)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not control.stop_requested():
        beats = control.heartbeats("generator")
        if any(int(b.get("version", -1)) >= version for b in beats.values()):
            return
        time.sleep(0.2)
    log.warning("no generator reported version %d within %.0fs", version, timeout_s)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="asyncrl learner rank (started by `asyncrl launch`)")
    ap.add_argument("--config", required=True)
    ap.add_argument("--log-file")
    args = ap.parse_args(argv)
    setup_logging(args.log_file, name=f"learner-{os.environ['RANK']}")
    serve(load_config(args.config), os.environ["ASYNCRL_REDIS_URL"], os.environ["ASYNCRL_PREFIX"])


def serve(cfg: Config, url: str, prefix: str) -> None:
    """Run the rank that ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR/PORT`` name, to the end of the run."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ.get("ASYNCRL_TORCH_THREADS", "1")))
    torch.manual_seed(0)
    control = RunControl(connect(url), prefix)
    buffer = buffers.setup(cfg.buffer, url, prefix)
    hide_triton_without_cuda()
    phase = start_phase(control, rank)
    init_distributed(cfg.learner.backend, phase)
    try:
        run(cfg, control, buffer, rank, world, phase)
    except StopRequested as exc:
        log.info("rank %d: %s", rank, exc)
    finally:
        buffer.close()
        dist.destroy_process_group()
    exit_after_collectives()  # reached only when the run ended well; an error above exits as usual


if __name__ == "__main__":
    main()
