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
                the groups it trained are acknowledged in the buffer

On start a rank restores the committed checkpoint if there is one (a restart after a crash) and
takes back the entries it had pending, judged again at the restored version.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from asyncrl import buffers
from asyncrl.buffers.consumer import BatchConsumer, ConsumerPolicy, StopRequested
from asyncrl.config import Config, load_config
from asyncrl.control import RunControl, connect
from asyncrl.learners.advantages import overlong_penalty
from asyncrl.learners.engine import (
    build_engine,
    export_hf,
    full_state_dict,
    init_distributed,
    load_committed,
    save_checkpoint,
)
from asyncrl.learners.loss import pad_batch, sequence_logprobs
from asyncrl.learners.models import build_critic, load_reference, reference_logprobs
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
from asyncrl.learners.presets import Preset, from_config
from asyncrl.metrics import RedisSink, setup_logging
from asyncrl.protocol import TrajectoryGroup
from asyncrl.staleness import staleness
from asyncrl.weights import setup_publisher

log = logging.getLogger("asyncrl.learner")


def make_batch(groups: list[TrajectoryGroup], cfg: Config, preset: Preset, pad_id: int, version: int) -> dict:
    """Padded tensors of this rank's groups: ids, masks, behaviour log-probs, rewards, group ids."""
    seqs = [(g.prompt_ids, s.tokens, s.logprobs) for g in groups for s in g.samples]
    batch = pad_batch(seqs, pad_id)
    # 1.0 where a response token was produced by the version this learner holds (for the mismatch metric)
    same = torch.zeros_like(batch["response_mask"])
    rows = [(len(g.prompt_ids), s.versions) for g in groups for s in g.samples]
    for i, (p, versions) in enumerate(rows):
        same[i, p - 1 : p - 1 + len(versions)] = torch.from_numpy((versions == version).astype(np.float32))
    batch["same_version"] = same
    rewards = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.tokens) for g in groups for s in g.samples])
    shaping = overlong_penalty(lengths, cfg.generator.max_new_tokens, preset.overlong_buffer, preset.overlong_penalty)
    batch["rewards"] = (rewards + shaping).to(torch.float32)
    batch["group_ids"] = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
    return batch


@dataclass
class Models:
    """What a rank trains and scores with: the policy engine, and what the preset needs besides."""

    policy: object  # DeepSpeed engine around the HF causal LM (the only model published to generators)
    critic: object | None = None  # DeepSpeed engine around learners.models.ValueModel
    reference: torch.nn.Module | None = None  # frozen initial policy, for the KL term


def build_models(cfg: Config, preset: Preset) -> Models:
    policy = build_engine(cfg)
    critic = build_critic(cfg) if preset.needs_critic else None
    reference = load_reference(cfg, policy.device) if preset.uses_kl else None
    return Models(policy, critic, reference)


def train_step(models: Models, batch: dict, cfg: Config, preset: Preset, world: int, reducer: Reducer | None = None):
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
    temperature, max_len = cfg.generator.temperature, cfg.generator.max_new_tokens
    ref = reference_logprobs(models.reference, batch, temperature) if models.reference is not None else None
    step = StepBatch(batch["rewards"], batch["group_ids"], batch["response_mask"], batch["behaviour_logprobs"])
    if cfg.learner.minibatches * cfg.learner.epochs == 1:
        logprobs, values = _forward(models, batch, temperature)
        out = step_loss(preset, step, logprobs, reducer, world, max_len, ref_logprobs=ref, values=values)
        _optimizer_step(models, out)
        return out, _mismatch(logprobs.detach(), batch)
    with torch.no_grad():
        prox, old_values = _forward(models, batch, temperature)
    inputs = prepare_batch(preset, step, prox, reducer, ref_logprobs=ref, old_values=old_values)
    outs = []
    for _ in range(cfg.learner.epochs):
        for rows in minibatch_rows(step.group_ids, cfg.learner.minibatches):
            sub = {k: batch[k][rows] for k in ("input_ids", "attention_mask")}
            logprobs, values = _forward(models, sub, temperature)
            out = minibatch_loss(
                preset, take_rows(step, rows), take_rows(inputs, rows), logprobs, reducer, world, max_len, values
            )
            _optimizer_step(models, out)
            outs.append(out)
    value_loss = torch.stack([o.value_loss.detach() for o in outs]).mean() if outs[0].value_loss is not None else None
    loss = torch.stack([o.policy_loss.detach() for o in outs]).mean()
    return StepLoss(loss, value_loss, mean_metrics([o.metrics for o in outs])), _mismatch(prox, batch)


def _forward(models: Models, batch: dict, temperature: float):
    """(log pi (B, T), V (B, T) or None) of the policy and critic on ``batch``'s rows."""
    logits = models.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logprobs = sequence_logprobs(logits, batch["input_ids"], temperature)
    values = models.critic(batch["input_ids"], batch["attention_mask"]) if models.critic is not None else None
    return logprobs, values


def _optimizer_step(models: Models, out: StepLoss) -> None:
    models.policy.backward(out.policy_loss)
    models.policy.step()
    if out.value_loss is not None:
        models.critic.backward(out.value_loss)
        models.critic.step()


def _mismatch(logprobs: torch.Tensor, batch: dict) -> tuple[float, float]:
    """Sum and count of |log pi - log mu| on tokens sampled by the version this learner holds."""
    diff = (logprobs - batch["behaviour_logprobs"]).abs() * batch["same_version"]
    return float(diff.sum()), float(batch["same_version"].sum())


def restore(models: Models, consumer: BatchConsumer, cfg: Config, rank: int) -> int:
    """Resume from the committed checkpoint (policy and critic), if any; take back this rank's pending
    entries. Returns the version to continue from (0 on a fresh start)."""
    restored = load_committed(models.policy, cfg.run_dir / "checkpoint", critic=models.critic)
    version, uses = restored if restored is not None else (0, {})
    counts = consumer.recover(version, uses)
    if restored is not None or any(counts.values()):
        log.info("rank %d resumes at version %d; pending entries taken back: %s", rank, version, counts)
    return version


def commit_due(cfg: Config, version: int) -> bool:
    every = cfg.learner.checkpoint_every
    return every > 0 and version % every == 0 and version < cfg.run.steps


def run(cfg: Config, control: RunControl, buffer, rank: int, world: int) -> None:
    from transformers import AutoTokenizer

    pad_id = AutoTokenizer.from_pretrained(cfg.model.path).pad_token_id
    preset = from_config(cfg.algorithm)
    models = build_models(cfg, preset)
    engine = models.policy
    metrics = RedisSink(control, f"learner/{rank}")
    reducer = DistReducer()
    need = cfg.learner.groups_per_step // world
    policy = ConsumerPolicy.from_config(cfg)
    policy = replace(policy, filter_zero_variance=policy.filter_zero_variance or preset.dynamic_filtering)
    consumer = BatchConsumer(buffer, f"rank{rank}", policy)
    ckpt_dir = cfg.run_dir / "checkpoint"
    start = restore(models, consumer, cfg, rank)
    if rank == 0:
        log.info("algorithm %s: %s", cfg.algorithm.name, preset)
    publisher = setup_publisher(cfg.weights) if rank == 0 else None
    state = full_state_dict(engine, cfg.learner.zero_stage)
    if publisher is not None:
        buffer.set_version(start)
        publisher.publish(start, state)
        control.set_meta("weights_address", publisher.address)
    t_start = time.time()
    for version in range(start, cfg.run.steps):
        # 1. collect
        t0 = time.perf_counter()
        batch = consumer.take(need, version, cfg.buffer.block_ms, stop=control.stop_requested)
        groups = batch.groups
        t_collect = time.perf_counter() - t0
        stale = [staleness(version, g.version) for g in groups]
        # 2-3. loss and step
        t0 = time.perf_counter()
        out, mismatch = train_step(models, make_batch(groups, cfg, preset, pad_id, version), cfg, preset, world)
        step_end_at = time.time()
        consumer.trained(batch)
        control.count_staleness(stale)
        t_train = time.perf_counter() - t0
        # 4. publish
        t0 = time.perf_counter()
        state = full_state_dict(engine, cfg.learner.zero_stage)
        if publisher is not None:
            buffer.set_version(version + 1)
            publisher.publish(version + 1, state)
        t_publish = time.perf_counter() - t0
        # 5. commit
        t0 = time.perf_counter()
        if commit_due(cfg, version + 1):
            save_checkpoint(engine, ckpt_dir, version + 1, consumer.checkpoint_state(), critic=models.critic)
            consumer.commit()
        elif cfg.learner.checkpoint_every == 0 and not cfg.learner.checkpoint:
            consumer.commit()  # nothing to resume from: a step is the only commit point there is
        t_commit = time.perf_counter() - t0
        # metrics: global over ranks
        c = batch.counts
        local = [sum(stale), len(stale), c["stale"], c["dead"], c["filtered"], batch.replays]
        samples = [s for g in groups for s in g.samples]
        mine = [sum(s.reward for s in samples), len(samples), sum(len(s.tokens) for s in samples)]
        sums = reducer.sum([*local, *mismatch, *mine])
        (max_stale,) = reducer.max([max(stale)])
        if rank == 0:
            stale_sum, n_groups, dropped_all, dead_all, filtered_all, replays_all, mm_sum, mm_count = sums[:8]
            reward_sum, n_samples, n_tokens = sums[8:]
            record = {
                **out.metrics,  # the algorithm's: loss, correction, KL, critic
                "learner/version": version + 1,
                "learner/tokens": n_tokens,
                "learner/lr": engine.get_lr()[0],
                "learner/behaviour_logprob_mismatch": mm_sum / mm_count if mm_count else None,
                "learner/reward_mean": reward_sum / n_samples,
                "learner/samples": n_samples,
                "learner/wall_seconds": time.time() - t_start,
                "buffer/staleness_mean": stale_sum / n_groups,
                "buffer/staleness_max": max_stale,
                "buffer/dropped_stale": dropped_all,
                "buffer/dead_letters": dead_all,
                "buffer/filtered_groups": filtered_all,
                "buffer/replays": replays_all,
                "time/collect_s": t_collect,
                "time/train_s": t_train,
                "time/publish_s": t_publish,
                "time/commit_s": t_commit,
                "time/step_end_at": step_end_at,
            }
            metrics.log(record)
        control.heartbeat("learner", str(rank), version=version + 1, pid=os.getpid())
    # the end: make sure a generator serves the final version (it runs the final evaluation)
    if rank == 0:
        control.set_meta("final_version", cfg.run.steps)
    if cfg.learner.checkpoint:
        save_checkpoint(engine, ckpt_dir, cfg.run.steps, consumer.checkpoint_state(), critic=models.critic)
        export_hf(engine, cfg, cfg.run_dir, state)
    consumer.commit(final=True)
    if publisher is not None:
        wait_for_generators(control, cfg.run.steps, timeout_s=120)
        publisher.close()


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
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    setup_logging(args.log_file, name=f"learner-{rank}")
    torch.set_num_threads(int(os.environ.get("ASYNCRL_TORCH_THREADS", "1")))
    torch.manual_seed(0)
    cfg = load_config(args.config)
    url, prefix = os.environ["ASYNCRL_REDIS_URL"], os.environ["ASYNCRL_PREFIX"]
    control = RunControl(connect(url), prefix)
    buffer = buffers.setup(cfg.buffer, url, prefix)
    init_distributed(cfg)
    try:
        run(cfg, control, buffer, rank, world)
    except StopRequested as exc:
        log.info("rank %d: %s", rank, exc)
    finally:
        buffer.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
