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
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from asyncrl import buffers
from asyncrl.buffers.consumer import Batch, BatchConsumer, ConsumerRules, StopRequested
from asyncrl.chat import ChatTokens
from asyncrl.config import AlgorithmConfig, Config, LearnerConfig, ModelConfig, load_config
from asyncrl.config.presets import Preset
from asyncrl.control import RunControl, connect
from asyncrl.data import load_jsonl
from asyncrl.keys import starting_field
from asyncrl.learners.advantages import overlong_penalty
from asyncrl.learners.batching import model_logprobs, pad_batch
from asyncrl.learners.engine import (
    build_engine,
    commit_due,
    export_hf,
    full_state_dict,
    hide_triton_without_cuda,
    init_distributed,
    load_committed,
    save_checkpoint,
)
from asyncrl.learners.lora import base_model
from asyncrl.learners.models import IMAGE_PREFIX, build_critic, image_inputs, load_reference, reference_logprobs
from asyncrl.learners.objective import (
    DistReducer,
    Reducer,
    StepBatch,
    StepLoss,
    mean_metrics,
    minibatch_loss,
    minibatch_rows,
    prepare_batch,
    step_loss,
    take_rows,
)
from asyncrl.learners.records import step_record, step_sums
from asyncrl.learners.vision import BatchImages, batch_images, published_names
from asyncrl.lifetime import exit_after_collectives, starting_up
from asyncrl.models.routers import RouterTap, add_aux_loss, choices_of, step_router_metrics
from asyncrl.observe import probe
from asyncrl.observe.metrics import RedisSink, Timings, setup_logging
from asyncrl.protocol import TrajectoryGroup
from asyncrl.secret import read_secret
from asyncrl.staleness import staleness
from asyncrl.weights import bus_address, setup_publisher
from asyncrl.weights.ties import module_aliases

log = logging.getLogger("asyncrl.learner")


def make_batch(
    groups: list[TrajectoryGroup],
    max_len: int,
    preset: Preset,
    pad_id: int,
    version: int,
    images: BatchImages | None = None,
) -> dict:
    """Padded tensors of this rank's groups: ids, masks, behaviour log-probs, rewards, group ids, and a
    vision-language policy's image inputs (``images``).

    ``max_len`` is the generation limit (``generator.max_new_tokens``): the DAPO overlong penalty's scale.
    """
    seqs = [(g.prompt_ids, s.tokens, s.logprobs, s.mask) for g in groups for s in g.samples]
    batch = pad_batch(seqs, pad_id)
    # 1.0 where a response token was produced by the version this learner holds (for the mismatch metric)
    same = torch.zeros_like(batch["response_mask"])
    rows = [(len(g.prompt_ids), s.versions) for g in groups for s in g.samples]
    for i, (p, versions) in enumerate(rows):
        same[i, p - 1 : p - 1 + len(versions)] = torch.from_numpy((versions == version).astype(np.float32))
    batch["same_version"] = same
    rewards = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float64)
    lengths = torch.tensor([int(s.mask.sum()) for g in groups for s in g.samples])  # model tokens
    shaping = overlong_penalty(lengths, max_len, preset.overlong_buffer, preset.overlong_penalty)
    batch["rewards"] = (rewards + shaping).to(torch.float32)
    batch["group_ids"] = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
    if any(s.turn_rewards is not None for g in groups for s in g.samples):  # multi-turn episodes
        turns = torch.zeros_like(batch["response_mask"])
        rows = [(len(g.prompt_ids), s.turn_rewards) for g in groups for s in g.samples]
        for i, (p, rewards) in enumerate(rows):
            if rewards is not None:
                turns[i, p - 1 : p - 1 + len(rewards)] = torch.from_numpy(rewards.astype(np.float32))
        batch["turn_rewards"] = turns
    return batch | (images.inputs(groups) if images is not None else {})


@dataclass
class Models:
    """What a rank trains and scores with: the policy engine, and what the preset needs besides."""

    policy: object  # DeepSpeed engine around the HF causal LM (the only model published to generators)
    critic: object | None = None  # DeepSpeed engine around learners.models.ValueModel
    reference: torch.nn.Module | None = None  # frozen initial policy, for the KL term
    routers: RouterTap | None = None  # a mixture of experts' routers (asyncrl.models.routers); None: the policy's

    def __post_init__(self) -> None:
        if self.routers is None:
            self.routers = RouterTap(self.policy)


@dataclass(frozen=True)
class ScoredSampling:
    """What the learner must know of the generators' sampling to score their tokens."""

    temperature: float  # pi and mu must be of the same (tempered) distribution
    max_len: int  # generator.max_new_tokens: L_max of seq-mean-token-sum, the overlong penalty's scale


def build_models(learner: LearnerConfig, model_cfg: ModelConfig, algorithm: AlgorithmConfig, steps: int) -> Models:
    preset = algorithm.preset
    policy = build_engine(learner, model_cfg, steps)
    critic = build_critic(learner, model_cfg, steps, algorithm.critic_lr) if preset.needs_critic else None
    reference = load_reference(model_cfg, policy.device) if preset.uses_kl else None
    return Models(policy, critic, reference)


def train_step(
    models: Models,
    batch: dict,
    preset: Preset,
    learner: LearnerConfig,
    sampling: ScoredSampling,
    world: int,
    reducer: Reducer | None = None,
):
    """Forward, the preset's losses, backward, optimizer step(s). Returns (StepLoss, mismatch sums).

    With ``learner.minibatches`` x ``learner.epochs`` == 1: one forward, one optimizer step; pi_prox and
    V_old are the detached outputs of that forward (exact, and free). Above 1: a no_grad forward of the
    policy (and critic) gives pi_prox and V_old once, the whole-batch inputs (advantages, KL reward) are
    computed from them, then every mini-batch takes its own optimizer step -- each a collective over the
    ranks, which all run the same number of mini-batches. The returned metrics average the steps.
    """
    engine = models.policy
    reducer = reducer if reducer is not None else DistReducer()
    batch = {k: v.to(engine.device) for k, v in batch.items()}
    temperature, max_len = sampling.temperature, sampling.max_len
    ref = reference_logprobs(models.reference, batch, temperature) if models.reference is not None else None
    step = StepBatch(
        batch["rewards"],
        batch["group_ids"],
        batch["response_mask"],
        batch["behaviour_logprobs"],
        batch.get("turn_rewards"),
    )
    tap, coef = models.routers, learner.router_aux_loss_coef
    if learner.minibatches * learner.epochs == 1:
        with tap:
            logprobs, values = _forward(models, batch, temperature)
        out = step_loss(preset, step, logprobs, reducer, world, max_len, ref_logprobs=ref, values=values)
        add_aux_loss(tap, out, coef)
        out.metrics.update(step_router_metrics(tap, reducer))
        _optimizer_step(models, out)
        return out, behaviour_mismatch(logprobs.detach(), batch)
    with torch.no_grad(), tap:
        prox, old_values = _forward(models, batch, temperature)
    routing = step_router_metrics(tap, reducer)  # over the whole batch
    inputs = prepare_batch(preset, step, prox, reducer, ref_logprobs=ref, old_values=old_values)
    outs = []
    for _ in range(learner.epochs):
        for rows in minibatch_rows(step.group_ids, learner.minibatches):
            keys = ("input_ids", "attention_mask", "response_mask", *(k for k in batch if k.startswith(IMAGE_PREFIX)))
            sub = {k: batch[k][rows] for k in keys}
            with tap:
                logprobs, values = _forward(models, sub, temperature)
            out = minibatch_loss(
                preset, take_rows(step, rows), take_rows(inputs, rows), logprobs, reducer, world, max_len, values
            )
            add_aux_loss(tap, out, coef)
            _optimizer_step(models, out)
            outs.append(out)
    value_loss = torch.stack([o.value_loss.detach() for o in outs]).mean() if outs[0].value_loss is not None else None
    loss = torch.stack([o.policy_loss.detach() for o in outs]).mean()
    metrics = {**mean_metrics([o.metrics for o in outs]), **routing}
    return StepLoss(loss, value_loss, metrics), behaviour_mismatch(prox, batch)


def _forward(models: Models, batch: dict, temperature: float):
    """(log pi (B, T), V (B, T) or None) of the policy and critic on ``batch``'s rows; log pi without the
    full-vocabulary logits (``batching.model_logprobs``)."""
    ids, mask, scored = batch["input_ids"], batch["attention_mask"], batch.get("response_mask")
    logprobs = model_logprobs(models.policy, ids, mask, temperature, scored, inputs=image_inputs(batch))  # 0 elsewhere
    values = models.critic(batch["input_ids"], batch["attention_mask"]) if models.critic is not None else None
    return logprobs, values


def _optimizer_step(models: Models, out: StepLoss) -> None:
    models.policy.backward(out.policy_loss)
    models.policy.step()
    if out.value_loss is not None:
        models.critic.backward(out.value_loss)
        models.critic.step()


def probe_of(models: Models, ids: list[int]) -> tuple[list[float], list | None]:
    """The weight-sync probe's log-probs and, for a mixture of experts, its expert choices (``choices_of``)."""
    with models.routers:
        logprobs = probe_logprobs(models.policy, ids)
    return logprobs, choices_of(models.routers)


@torch.no_grad()
def probe_logprobs(engine, ids: list[int]) -> list[float]:
    """Log-probs of the weight-sync probe ``ids[1:]`` under the policy, at temperature 1 (``asyncrl.observe.probe``)."""
    x = torch.tensor([ids], device=engine.device)
    logits = engine(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].tolist()


def behaviour_mismatch(logprobs: torch.Tensor, batch: dict) -> tuple[float, float]:
    """Sum and count of |log pi - log mu| over the response tokens that the version this learner holds
    sampled (``batch["same_version"]``), pi at batch start: what ``learner/behaviour_logprob_mismatch``
    averages. Only there are pi and mu the same weights, so only there does the difference measure the
    engines' disagreement and not the policy's change; the learner keeps no older weights, so stale
    tokens are left out, and at a lag of 1 or more few or none remain (the figure is then null). The
    weight-sync probe covers every version (``asyncrl.observe.probe``: ``weights/probe_logprob_diff_max``
    in the same record)."""
    diff = (logprobs - batch["behaviour_logprobs"]).abs() * batch["same_version"]
    return float(diff.sum()), float(batch["same_version"].sum())


def restore(models: Models, consumer: BatchConsumer, ckpt_dir: Path, rank: int) -> int:
    """Resume from the committed checkpoint (policy and critic), if any; take back this rank's pending
    entries. Returns the version to continue from (0 on a fresh start)."""
    restored = load_committed(models.policy, ckpt_dir, critic=models.critic)
    version, uses = restored if restored is not None else (0, {})
    counts = consumer.recover(version, uses)
    if restored is not None or any(counts.values()):
        log.info("rank %d resumes at version %d; pending entries taken back: %s", rank, version, counts)
    return version


def start_phase(control: RunControl, rank: int) -> Callable[[str], None]:
    """``phase(what)``: what this rank waits for while it starts, in its log and in the run's metadata (until it
    is up: :func:`run`), where the launcher reads it about a rank that is not up in time (``asyncrl.keys``)."""
    field = starting_field("learner", rank)

    def phase(what: str) -> None:
        log.info("start-up: %s", what)
        control.set_meta(field, json.dumps({"what": what, "since": time.time()}))

    return phase


def run(cfg: Config, control: RunControl, buffer, rank: int, world: int, phase=lambda what: None) -> None:
    """The learner rank's loop (the module doc's phases), from its restored version to ``run.steps``."""
    with starting_up():  # the collector's passes left for the end of set-up (asyncrl.lifetime)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        ep = cfg.episode
        chat = ChatTokens(tokenizer, use_template=ep.chat_template, system_prompt=ep.system_prompt)  # the generators'
        images = batch_images(cfg.model.path)  # a vision-language policy's pixel inputs
        pad_id = tokenizer.pad_token_id
        probe_seq = probe.probe_ids(chat, load_jsonl(cfg.data.train)[0], images.vision if images else None)
        preset = cfg.algorithm.preset
        phase("loading the model into DeepSpeed")
        models = build_models(cfg.learner, cfg.model, cfg.algorithm, cfg.run.steps)
        engine = models.policy
        keep = published_names(engine, cfg.model)  # a VLM's language model alone, its vision frozen
        sampling = ScoredSampling(cfg.generator.temperature, cfg.generator.max_new_tokens)
        metrics = RedisSink(control, f"learner/{rank}")
        reducer = DistReducer()
        need = cfg.learner.groups_per_step // world
        rules = ConsumerRules(
            max_policy_lag=cfg.run.max_policy_lag,
            replay_times=cfg.buffer.replay_times,
            filter_zero_variance=cfg.buffer.filter_zero_variance or preset.dynamic_filtering,
            max_frame_bytes=int(cfg.buffer.max_frame_mb * (1 << 20)),
        )
        consumer = BatchConsumer(buffer, f"rank{rank}", rules)
        ckpt_dir = cfg.run_dir / "checkpoint"
        phase("restoring the committed checkpoint, if any")
        start = restore(models, consumer, ckpt_dir, rank)
        if rank == 0:
            log.info("algorithm %s: %s", cfg.algorithm.name, preset)
        publisher = start_publisher(cfg) if rank == 0 else None
        # the probe's forward is a collective under ZeRO-3 (every rank); otherwise rank 0, which publishes, alone
        probing = publisher is not None or cfg.learner.zero_stage == 3
        probed = probe_of(models, probe_seq) if probing else None
        state = full_state_dict(engine, cfg.learner.zero_stage, keep)
        if publisher is not None:
            # before any generator applies; a LoRA policy's names are its HF model's
            control.set_meta("tied", json.dumps(module_aliases(base_model(engine.module))))
            probe.publish(control, start, *probed)
            buffer.set_version(start)
            publisher.publish(start, state)
            control.set_meta("weights_address", publisher.address)
    control.forget_meta(starting_field("learner", rank))
    log.info("rank %d ready at version %d", rank, start)  # a start-up phase (scripts/bench/startup.py)
    t_start = time.time()
    timings = Timings()
    committed = start  # the version of the last committed checkpoint (or commit without one)
    for version in range(start, cfg.run.steps):
        timings.reset()
        # 1. collect; a stop (Ctrl-C) commits what was trained since the last checkpoint
        batch = take_unless_stopping(consumer, need, version, cfg.buffer.block_ms, control, reducer)
        if batch is None:
            stop_at(cfg, models, consumer, version, committed)
        groups = batch.groups
        stale = [staleness(version, g.version) for g in groups]
        timings.time("collect")
        # 2-3. loss and step
        out, mismatch = train_step(
            models,
            make_batch(groups, sampling.max_len, preset, pad_id, version, images),
            preset,
            cfg.learner,
            sampling,
            world,
        )
        step_end_at = time.time()
        consumer.trained(batch)
        log.info("step %d trained %s", version + 1, " ".join(g.id for g in groups))  # lineage (scripts/chaos.py)
        control.count_staleness(stale)
        timings.time("train")
        # 4. publish (the probe first: a generator applying the version finds it)
        probed = probe_of(models, probe_seq) if probing else None
        state = full_state_dict(engine, cfg.learner.zero_stage, keep)
        if publisher is not None:
            probe.publish(control, version + 1, *probed)
            buffer.set_version(version + 1)
            publisher.publish(version + 1, state)
        timings.time("publish")
        # metrics, global over ranks, before the commit: a committed version always has its record
        total = reducer.sum_dict(step_sums(groups, batch, stale, mismatch))
        (max_stale,) = reducer.max([max(stale)])
        if rank == 0:
            record = step_record(version + 1, out, total, max_stale, engine.get_lr()[0], probe.read_health(control))
            record.update(timings.record())
            record["learner/wall_seconds"] = time.time() - t_start
            metrics.log({**record, "time/step_end_at": step_end_at})
        # 5. commit
        if commit_step(cfg, models, consumer, version + 1, metrics if rank == 0 else None):
            committed = version + 1
        control.heartbeat("learner", str(rank), version=version + 1, pid=os.getpid())
    # the end: make sure a generator serves the final version (it runs the final evaluation)
    if rank == 0:
        control.set_meta("final_version", cfg.run.steps)
    if cfg.learner.checkpoint:
        save_checkpoint(engine, ckpt_dir, cfg.run.steps, consumer.checkpoint_state(), critic=models.critic)
        whole = state if keep is None else full_state_dict(engine, cfg.learner.zero_stage)  # the frozen tower too
        export_hf(engine, cfg.model.path, cfg.run_dir / "export", whole, cfg.model.lora)
        log.info("rank %d: final checkpoint and export written", rank)
    consumer.commit(final=True)
    if publisher is not None:
        wait_for_generators(control, cfg.run.steps, timeout_s=120)
        publisher.close()
        log.info("rank 0: a generator serves version %d; publisher closed", cfg.run.steps)


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
