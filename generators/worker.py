"""One generator process: the loop that turns prompts into scored trajectory groups.

Each pass of the loop, between engine calls:
  1. weights  - apply the newest verified version from the weight bus (never a partial one), through
                the ``WeightFeed``; with ``generator.engine.on_weight_update`` continue | abort the
                engine also asks the feed between its steps, and tokens carry the version that
                produced each
  2. eval     - if this version is due for a greedy held-out evaluation and no other generator
                claimed it, run it
  3. admit    - claim up to ``groups_in_flight`` groups under admission control, keyed on the
                version this engine serves (so it never starts work that could only arrive stale)
  4. generate - n samples per claimed prompt, with behaviour log-probs and per-token versions
  5. score    - reward per sample; a failing reward marks the group failed, never the process
  6. push     - one msgpack frame per group into the buffer
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import time
import zlib

import numpy as np

from asyncrl import buffers
from asyncrl.buffers.base import live_groups
from asyncrl.config import DataConfig, GeneratorConfig, RunConfig, load_config
from asyncrl.control import RunControl, connect
from asyncrl.data import import_by_path, load_jsonl, prompt_for_sequence
from asyncrl.generators.engine import Engine, Sampling, fits
from asyncrl.generators.engine import setup as setup_engine
from asyncrl.generators.weight_feed import WeightFeed
from asyncrl.metrics import RedisSink, setup_logging
from asyncrl.protocol import Sample, TrajectoryGroup, encode_group
from asyncrl.staleness import admission_limit, claim_share
from asyncrl.weights import WeightSubscriber, setup_subscriber

log = logging.getLogger("asyncrl.generator")


def eval_versions(run: RunConfig) -> set[int]:
    """Versions that get a greedy held-out evaluation: the first, every ``eval_every``, the last."""
    every = run.eval_every
    due = set(range(0, run.steps, every)) if every else {0}
    return due | {run.steps}


class Generator:
    def __init__(
        self,
        gen: GeneratorConfig,
        data: DataConfig,
        run: RunConfig,
        groups_per_step: int,
        *,
        ident: str,
        engine: Engine,
        buffer,
        control: RunControl,
        tokenizer,
        subscriber: WeightSubscriber,
    ):
        """``groups_per_step`` is the learner's B (admission control); the weights on disk, which
        ``engine`` starts from, are version 0."""
        self.gen_cfg, self.run_cfg, self.groups_per_step = gen, run, groups_per_step
        self.ident = ident
        self.engine = engine
        self.buffer = buffer
        self.control = control
        self.tok = tokenizer
        self.metrics = RedisSink(control, f"generator/{ident}")
        heartbeat = functools.partial(control.heartbeat, "generator", ident, pid=os.getpid())
        self.feed = WeightFeed(subscriber, self.metrics, heartbeat, version=0)
        self.records = load_jsonl(data.train)
        eval_records = load_jsonl(data.eval)[: data.eval_size] if data.eval else []
        encoded = [(r, tokenizer.encode(r["prompt"])) for r in eval_records]
        self.eval_set = [(r, ids) for r, ids in encoded if self._fits(ids, gen.max_new_tokens)]  # encoded once
        if len(self.eval_set) < len(eval_records):
            log.warning(
                "%d eval prompts do not fit the model's context: left out", len(eval_records) - len(self.eval_set)
            )
        self.reward_fn = import_by_path(data.reward)
        self.due_evals = eval_versions(run) if gen.eval else set()
        self.sampling = Sampling(
            n=gen.n_samples,
            temperature=gen.temperature,
            top_p=gen.top_p,
            max_new_tokens=gen.max_new_tokens,
        )

    @property
    def version(self) -> int:
        """The weights version the engine serves."""
        return self.feed.version

    # -- phases ------------------------------------------------------------------------------------
    def apply_weights(self, timeout_ms: int = 0) -> None:
        self.feed.apply(self.engine, timeout_ms)

    def maybe_evaluate(self) -> None:
        if self.version not in self.due_evals or not self.eval_set:
            return
        self.due_evals.discard(self.version)
        if not self.control.claim_once(f"eval:{self.version}"):
            return
        t0 = time.perf_counter()
        greedy = Sampling(n=1, temperature=0.0, top_p=1.0, max_new_tokens=self.sampling.max_new_tokens)
        outs = self.engine.generate([ids for _, ids in self.eval_set], greedy, self.version)
        rewards = [self._score(r, o[0].tokens) for (r, _), o in zip(self.eval_set, outs, strict=True)]
        record = {
            "eval/version": self.version,
            "eval/reward_mean": float(np.mean(rewards)),
            "eval/exact_rate": float(np.mean([r >= 1.0 for r in rewards])),
            "eval/seconds": time.perf_counter() - t0,
        }
        self.metrics.log(record)
        log.info("eval at version %d: reward %.3f", self.version, record["eval/reward_mean"])

    def admit(self) -> list[int]:
        k, b = self.run_cfg.max_policy_lag, self.groups_per_step
        live = live_groups(self.buffer.stats())
        share = claim_share(
            admission_limit(self.version, k, b) - live, self.run_cfg.generators, self.gen_cfg.groups_in_flight, b
        )
        seqs = []
        while len(seqs) < share:  # each claim is atomic; the share only spreads them
            seq = self.buffer.try_start_group(self.version, k, b)
            if seq is None:
                break
            seqs.append(seq)
        return seqs

    def _fits(self, prompt: list[int], max_new_tokens: int) -> bool:
        return fits(len(prompt), max_new_tokens, self.engine.max_model_len)

    def generate(self, seqs: list[int]) -> list[TrajectoryGroup]:
        claims = [prompt_for_sequence(s, len(self.records), self.run_cfg.seed) for s in seqs]
        prompts = [self.tok.encode(self.records[idx]["prompt"]) for _, idx in claims]
        keep = [i for i, p in enumerate(prompts) if self._fits(p, self.sampling.max_new_tokens)]
        too_long = len(prompts) - len(keep)
        if too_long:  # never an engine error: skipped, counted, their admission slots given back
            claims, prompts = [claims[i] for i in keep], [prompts[i] for i in keep]
            self.control.set_inflight(self.ident, len(keep))  # first: a crash in between leaks, never frees twice
            self.buffer.release(too_long)
            log.warning(
                "%d prompts leave no room in the %d-token context: skipped", too_long, self.engine.max_model_len
            )
        if not prompts:
            self.metrics.log({"generator/version": self.version, "generator/prompts_too_long": too_long})
            return []
        t0 = time.perf_counter()
        mode = self.gen_cfg.engine.on_weight_update
        if mode == "wait":
            outs = self.engine.generate(prompts, self.sampling, self.version)
        else:
            outs = self.engine.generate_updating(prompts, self.sampling, self.feed, mode)
        seconds = time.perf_counter() - t0
        groups = []
        for (epoch, idx), prompt, comps in zip(claims, prompts, outs, strict=True):
            samples = [
                Sample(
                    tokens=np.asarray(c.tokens, dtype=np.int32),
                    logprobs=np.asarray(c.logprobs, dtype=np.float32),
                    versions=np.asarray(c.versions, dtype=np.int32),
                    reward=self._score(self.records[idx], c.tokens),
                    finish_reason=c.finish_reason,
                )
                for c in comps
            ]
            groups.append(TrajectoryGroup(np.asarray(prompt, np.int32), samples, idx, epoch, self.ident))
        tokens = sum(g.num_tokens for g in groups)
        self.metrics.log(
            {
                "generator/version": self.version,
                "generator/tokens_per_s": tokens / max(seconds, 1e-9),
                "generator/groups": len(groups),
                "generator/reward_mean": float(np.mean([g.rewards.mean() for g in groups])),
                "generator/generate_seconds": seconds,
                "generator/prompts_too_long": too_long,
            }
        )
        return groups

    def push(self, groups: list[TrajectoryGroup]) -> None:
        for g in groups:
            self.buffer.push(g.id, encode_group(g), producer=self.ident)

    def _score(self, record: dict, tokens: list[int]) -> float:
        text = self.tok.decode(tokens, skip_special_tokens=True)
        try:
            return float(self.reward_fn(record["prompt"], text, record))
        except Exception:  # a broken reward marks the sample, never kills the generator
            log.exception("reward function failed on prompt %r", record["prompt"])
            return 0.0

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, block_ms: int) -> None:
        """Until the run stops or the launcher dies; ``block_ms`` is how long a wait for weights blocks."""
        parent = os.getppid()
        while not self.control.stop_requested() and os.getppid() == parent:
            self.apply_weights()
            self.maybe_evaluate()
            self.control.heartbeat("generator", self.ident, version=self.version, pid=os.getpid())
            if self.version >= self.run_cfg.steps:  # the learner is done: only the final eval is left
                self.apply_weights(timeout_ms=block_ms)
                continue
            seqs = self.admit()
            if not seqs:  # admission closed until newer weights arrive
                self.apply_weights(timeout_ms=block_ms)
                continue
            self.control.set_inflight(self.ident, len(seqs))
            self.push(self.generate(seqs))
            self.control.set_inflight(self.ident, 0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="asyncrl generator process (started by `asyncrl launch`)")
    ap.add_argument("--config", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--incarnation", type=int, default=0, help="restart count; varies the sampling seed")
    ap.add_argument("--log-file")
    args = ap.parse_args(argv)
    setup_logging(args.log_file, name=f"generator-{args.id}")
    cfg = load_config(args.config)
    url, prefix = os.environ["ASYNCRL_REDIS_URL"], os.environ["ASYNCRL_PREFIX"]
    control = RunControl(connect(url), prefix)
    buffer = buffers.setup(cfg.buffer, url, prefix)

    from transformers import AutoTokenizer

    seed = zlib.crc32(f"{cfg.run.seed}/{args.id}/{args.incarnation}".encode())
    max_num_seqs = max(64, cfg.generator.groups_in_flight * cfg.generator.n_samples)
    engine = setup_engine(cfg.generator.engine, cfg.model, max_num_seqs, seed)
    address = control.wait_meta("weights_address", timeout_s=600)
    subscriber = setup_subscriber(cfg.weights, address, subscriber_id=f"generator-{args.id}")
    gen = Generator(
        cfg.generator,
        cfg.data,
        cfg.run,
        cfg.learner.groups_per_step,
        ident=args.id,
        engine=engine,
        buffer=buffer,
        control=control,
        tokenizer=AutoTokenizer.from_pretrained(cfg.model.path),
        subscriber=subscriber,
    )
    log.info("generator %s up (engine %s)", args.id, cfg.generator.engine.type)
    try:
        gen.run(cfg.buffer.block_ms)
    finally:
        subscriber.close()
        buffer.close()
        engine.close()


if __name__ == "__main__":
    main()
