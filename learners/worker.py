"""One learner rank: the loop that turns buffered trajectory groups into policy versions.

All ranks step in lockstep (the gradient all-reduce is a barrier). Each step, at version v:
  1. collect  - B / L groups for this rank through its BatchConsumer (``buffers/consumer.py``):
                stale, filtered and undecodable groups are acknowledged with that outcome and do
                not count; replays fill in when the buffer has too few new groups
  2. loss     - GRPO advantages per group, learner log-probs, token-TIS-corrected policy gradient,
                normalised by the global token count so the split across ranks does not matter
  3. step     - DeepSpeed backward + optimizer step: version v + 1
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

import numpy as np
import torch
import torch.distributed as dist

from asyncrl import buffers
from asyncrl.buffers.consumer import BatchConsumer, ConsumerPolicy, StopRequested
from asyncrl.config import Config, load_config
from asyncrl.control import RunControl, connect
from asyncrl.learners.engine import (
    build_engine,
    export_hf,
    full_state_dict,
    init_distributed,
    load_committed,
    save_checkpoint,
)
from asyncrl.learners.loss import PolicyBatch, group_advantages, grpo_tis_loss, pad_batch, sequence_logprobs
from asyncrl.metrics import RedisSink, setup_logging
from asyncrl.protocol import TrajectoryGroup
from asyncrl.staleness import staleness
from asyncrl.weights import setup_publisher

log = logging.getLogger("asyncrl.learner")


def make_batch(groups: list[TrajectoryGroup], cfg: Config, pad_id: int, version: int) -> dict:
    rewards = torch.tensor(np.stack([g.rewards for g in groups]))  # (G, n)
    adv = group_advantages(rewards, cfg.algorithm.normalize_std, cfg.algorithm.adv_eps)
    seqs = [(g.prompt_ids, s.tokens, s.logprobs) for g in groups for s in g.samples]
    batch = pad_batch(seqs, pad_id)
    # 1.0 where a response token was produced by the version this learner holds (for the mismatch metric)
    same = torch.zeros_like(batch["response_mask"])
    rows = [(len(g.prompt_ids), s.versions) for g in groups for s in g.samples]
    for i, (p, versions) in enumerate(rows):
        same[i, p - 1 : p - 1 + len(versions)] = torch.from_numpy((versions == version).astype(np.float32))
    batch["same_version"] = same
    batch["advantages"] = adv.reshape(-1).to(torch.float32)
    return batch


def _collective_device() -> torch.device:
    """NCCL reduces only CUDA tensors; gloo only CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def global_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t)
    return t.tolist()


def global_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def train_step(engine, batch: dict, cfg: Config, world: int):
    """Forward, loss, backward, optimizer step. Returns the loss output and global token count."""
    batch = {k: v.to(engine.device) for k, v in batch.items()}
    local_tokens = float(batch["response_mask"].sum())
    (total_tokens,) = global_sum([local_tokens])
    logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logprobs = sequence_logprobs(logits, batch["input_ids"], cfg.generator.temperature)
    policy = PolicyBatch(
        logprobs=logprobs,
        behaviour_logprobs=batch["behaviour_logprobs"],
        advantages=batch["advantages"],
        mask=batch["response_mask"],
    )
    # DeepSpeed averages gradients over ranks; N / L makes the sum the full-batch gradient.
    out = grpo_tis_loss(policy, cfg.algorithm.tis_cap, total_tokens / world)
    engine.backward(out.loss)
    engine.step()
    diff = (logprobs.detach() - batch["behaviour_logprobs"]).abs() * batch["same_version"]
    mismatch = (float(diff.sum()), float(batch["same_version"].sum()))
    return out, total_tokens, mismatch


def restore(engine, consumer: BatchConsumer, cfg: Config, rank: int) -> int:
    """Resume from the committed checkpoint, if any; take back this rank's pending entries.

    Returns the version to continue from (0 on a fresh start)."""
    restored = load_committed(engine, cfg.run_dir / "checkpoint")
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
    engine = build_engine(cfg)
    metrics = RedisSink(control, f"learner/{rank}")
    need = cfg.learner.groups_per_step // world
    consumer = BatchConsumer(buffer, f"rank{rank}", ConsumerPolicy.from_config(cfg))
    ckpt_dir = cfg.run_dir / "checkpoint"
    start = restore(engine, consumer, cfg, rank)
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
        out, total_tokens, mismatch = train_step(engine, make_batch(groups, cfg, pad_id, version), cfg, world)
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
            save_checkpoint(engine, ckpt_dir, version + 1, consumer.checkpoint_state())
            consumer.commit()
        elif cfg.learner.checkpoint_every == 0 and not cfg.learner.checkpoint:
            consumer.commit()  # nothing to resume from: a step is the only commit point there is
        t_commit = time.perf_counter() - t0
        # metrics: global over ranks
        c = batch.counts
        local = [out.loss.item(), sum(stale), len(stale), c["stale"], c["dead"], c["filtered"], batch.replays]
        sums = global_sum([*local, *mismatch])
        max_stale = global_max(max(stale))
        if rank == 0:
            loss, stale_sum, n_groups, dropped_all, dead_all, filtered_all, replays_all, mm_sum, mm_count = sums
            record = {
                "learner/version": version + 1,
                "learner/loss": loss,
                "learner/tokens": total_tokens,
                "learner/lr": engine.get_lr()[0],
                "learner/behaviour_logprob_mismatch": mm_sum / mm_count if mm_count else None,
                "learner/tis_clip_frac": out.tis_clip_frac,
                "learner/tis_weight_mean": out.tis_weight_mean,
                "learner/behaviour_kl": out.behaviour_kl,
                "learner/reward_mean": float(np.mean([g.rewards.mean() for g in groups])),
                "learner/samples": n_groups * cfg.generator.n_samples,
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
        save_checkpoint(engine, ckpt_dir, cfg.run.steps, consumer.checkpoint_state())
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
