"""One rank of an offline training run (``asyncrl sft``, ``asyncrl rm``, ``asyncrl dpo``; started by
``asyncrl.offline.launch``), on the RL learner's DeepSpeed engine (``deepspeed_engine.build_engine``: ZeRO stage,
AdamW, lr schedule, clipping, activation checkpointing) and the RL run's directory layout.

Step s trains on the examples at positions s*B .. (s+1)*B-1 of the epochs' seeded permutations, one
after another; rank r takes the r-th of W equal slices. Losses and metrics are each rank's share of
the whole batch's (``offline_losses``), so a step over W ranks is the step over their union on one.
DPO's reference log-probs are the initial policy's, computed once before the first step for every
example this rank will see (no second model in memory). Rank 0 writes ``metrics.jsonl`` and
``tensorboard/`` (``learner/*`` at each step, ``eval/*`` at each evaluation) and the export:
``export/`` (an HF model; for rm, the base model plus ``reward_head.safetensors``). A checkpoint is
committed every ``learner.checkpoint_every`` steps and at the end (``deepspeed_engine.save_checkpoint``); a rank
that finds one in its run directory (``asyncrl sft --resume runs/NAME``) goes on from that step, with
the same examples in the same order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from asyncrl.chat import ChatTokens
from asyncrl.config import load_config
from asyncrl.config.offline import OfflineConfig
from asyncrl.learners.deepspeed_engine import (
    build_engine,
    commit_due,
    export_hf,
    full_state_dict,
    hide_triton_without_cuda,
    init_distributed,
    load_committed,
    save_checkpoint,
)
from asyncrl.learners.objective import DistReducer
from asyncrl.learners.offline_losses import (
    PAIR_LOSSES,
    bradley_terry_loss,
    dpo_loss,
    pair_logratio,
    response_logprobs,
    sft_loss,
)
from asyncrl.lifetime import exit_after_collectives, starting_up
from asyncrl.models.reward_head import RewardModel, pad_pairs
from asyncrl.observe.metrics import JsonlSink, Sinks, TensorBoardSink, setup_logging
from asyncrl.offline.data import Example, load_examples
from asyncrl.rewards.model import REWARD_HEAD, SETTINGS

log = logging.getLogger("asyncrl.offline")
REWARD_TIMEOUT_S = 30.0  # one greedy evaluation completion's reward call


def step_indices(n: int, batch: int, step: int, seed: int) -> list[int]:
    """The examples of step ``step`` (0-based): ``batch`` positions onward in the epochs' permutations."""
    out: list[int] = []
    while len(out) < batch:
        epoch, offset = divmod(step * batch + len(out), n)
        order = np.random.default_rng([seed, epoch]).permutation(n)
        out += order[offset : offset + batch - len(out)].tolist()
    return out


class Trainer:
    """The rank's engine and examples, and one loss per mode: each returns this rank's part of the loss and
    its additive share of each metric (summed over ranks, the whole batch's value)."""

    def __init__(self, cfg: OfflineConfig, mode: str, rank: int, world: int):
        from transformers import AutoModel, AutoTokenizer

        self.cfg, self.mode, self.rank, self.world = cfg, mode, rank, world
        self.tok = AutoTokenizer.from_pretrained(cfg.model.path)
        self.chat = ChatTokens(self.tok, use_template=cfg.data.chat_template, system_prompt=cfg.data.system_prompt)
        self.train = load_examples(cfg.data.train, mode, self.chat, cfg.data.max_len)
        held_out = load_examples(cfg.data.eval, mode, self.chat, cfg.data.max_len) if cfg.data.eval else []
        n = min(len(held_out), cfg.data.eval_size)
        self.eval = held_out[: n - n % world]  # an equal share per rank
        self.reducer = DistReducer()
        dtype = getattr(torch, cfg.model.dtype)
        if mode == "rm":
            base = AutoModel.from_pretrained(cfg.model.path, dtype=dtype)
            model = RewardModel(base, base.config.hidden_size).to(dtype)
            self.engine = build_engine(cfg.learner, cfg.model, cfg.run.steps, model=model)
        else:
            self.engine = build_engine(cfg.learner, cfg.model, cfg.run.steps)
        self.reference: dict[tuple[str, int], tuple[float, float]] = {}
        if mode == "dpo":
            self._reference_logprobs()

    # -- the rank's examples ------------------------------------------------------------------------------
    def step_share(self, step: int) -> list[tuple[str, int]]:
        batch = self.cfg.train.batch_size
        picked = step_indices(len(self.train), batch, step, self.cfg.run.seed)
        share = batch // self.world
        return [("train", i) for i in picked[self.rank * share : (self.rank + 1) * share]]

    def example(self, key: tuple[str, int]) -> Example:
        return (self.train if key[0] == "train" else self.eval)[key[1]]

    def _reference_logprobs(self) -> None:
        keys = {k for s in range(self.cfg.run.steps) for k in self.step_share(s)}
        keys |= {("eval", i) for i in range(self.rank, len(self.eval), self.world)}
        mean = PAIR_LOSSES[self.cfg.train.dpo_loss][1]
        ordered, chunk = sorted(keys), max(1, self.cfg.train.batch_size // self.world)
        parts = [ordered[i : i + chunk] for i in range(0, len(ordered), chunk)]
        rounds = int(self.reducer.max([float(len(parts))])[0])  # ZeRO 3 gathers: as many forwards on each rank
        parts += [parts[-1]] * (rounds - len(parts))
        with torch.no_grad():
            for part in parts:
                batch = self._pairs_batch(part)
                lr = pair_logratio(response_logprobs(self.engine, batch), batch["response_mask"], mean).double()
                for j, key in enumerate(part):
                    self.reference[key] = (float(lr[2 * j]), float(lr[2 * j + 1]))
        log.info("rank %d: reference log-probs of %d pairs", self.rank, len(ordered))

    def _sft_batch(self, keys: list[tuple[str, int]]) -> dict:
        return pad_pairs([(self.example(k).prompt_ids, self.example(k).responses[0]) for k in keys], self.chat.pad_id)

    def _pairs_batch(self, keys: list[tuple[str, int]]) -> dict:
        pairs = [(self.example(k).prompt_ids, r) for k in keys for r in self.example(k).responses]
        return pad_pairs(pairs, self.chat.pad_id)

    # -- the losses ---------------------------------------------------------------------------------------
    def loss(self, keys: list[tuple[str, int]], total_pairs: int) -> tuple[torch.Tensor, dict[str, float]]:
        if self.mode == "sft":
            batch = self._sft_batch(keys)
            tokens = self.reducer.sum([float(batch["response_mask"].sum())])[0]
            loss = sft_loss(response_logprobs(self.engine, batch), batch["response_mask"], tokens, self.world)
            return loss, {"loss": float(loss.detach()) / self.world}
        batch = self._pairs_batch(keys)
        if self.mode == "rm":
            scores = self.engine(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
            chosen, rejected = scores[0::2], scores[1::2]
            loss = bradley_terry_loss(chosen, rejected, total_pairs, self.world)
            margin = (chosen - rejected).detach()
        else:
            name, beta = self.cfg.train.dpo_loss, self.cfg.train.dpo_beta
            lr = pair_logratio(response_logprobs(self.engine, batch), batch["response_mask"], PAIR_LOSSES[name][1])
            ref = torch.tensor([self.reference[k] for k in keys], dtype=lr.dtype).reshape(-1, 2)
            loss, h = dpo_loss(name, beta, (lr[0::2], lr[1::2]), (ref[:, 0], ref[:, 1]), total_pairs, self.world)
            margin = beta * h
        share = {"accuracy": float((margin > 0).sum()), "margin": float(margin.sum())}
        return loss, {"loss": float(loss.detach()) / self.world, **{k: v / total_pairs for k, v in share.items()}}

    def train_step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        loss, share = self.loss(self.step_share(step), self.cfg.train.batch_size)
        self.engine.backward(loss)
        self.engine.step()
        metrics = self.reducer.sum_dict(share)
        return {f"learner/{k}": v for k, v in metrics.items()} | {"learner/step_s": time.perf_counter() - start}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The held-out loss and metrics (and the greedy reward where ``data.reward`` names one), the
        held-out set split over the ranks in equal shares (the same forwards on each: ZeRO 3 gathers)."""
        mine = [("eval", i) for i in range(self.rank, len(self.eval), self.world)]
        chunk = max(1, self.cfg.train.batch_size // self.world)
        rounds = [mine[i : i + chunk] for i in range(0, len(mine), chunk)]
        if self.mode == "sft":
            nll = 0.0
            for keys in rounds:
                batch = self._sft_batch(keys)
                nll -= float((response_logprobs(self.engine, batch) * batch["response_mask"]).sum())
            tokens = sum(len(self.example(k).responses[0]) for k in mine)
            nll, total_tokens = self.reducer.sum([nll, float(tokens)])
            out = {"loss": nll / max(total_tokens, 1.0)}
        else:
            totals = {"loss": 0.0, "accuracy": 0.0, "margin": 0.0}
            for keys in rounds:
                for k, v in self.loss(keys, len(self.eval))[1].items():
                    totals[k] += v
            out = self.reducer.sum_dict(totals)
        if self.cfg.data.reward and self.mode != "rm":
            out["reward"] = self._greedy_reward(mine)
        return {f"eval/{k}": v for k, v in out.items()}

    def _greedy_reward(self, keys: list[tuple[str, int]]) -> float:
        from asyncrl.rewards.resolve import load_reward, score

        fn, module = load_reward(self.cfg.data.reward, REWARD_TIMEOUT_S), self.engine.module
        stops, total = set(self.chat.stop_token_ids), 0.0
        for start in range(0, len(keys), 32):
            part = [self.example(k) for k in keys[start : start + 32]]
            batch = pad_pairs([(e.prompt_ids, []) for e in part], self.chat.pad_id, side="left")
            out = module.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                max_new_tokens=self.cfg.train.max_new_tokens,
                do_sample=False,
                pad_token_id=self.chat.pad_id,
                eos_token_id=sorted(stops) or None,
            )
            for e, row in zip(part, out[:, batch["input_ids"].shape[1] :].tolist(), strict=True):
                cut = next((i for i, t in enumerate(row) if t in stops), len(row))
                text = self.tok.decode(row[:cut], skip_special_tokens=True)
                prompt = self.chat.prompt_text(e.prompt)
                total += sum(asyncio.run(score(fn, prompt, text, e.record, REWARD_TIMEOUT_S)).values())
        return self.reducer.sum([total])[0] / max(1, len(self.eval))

    # -- the export ---------------------------------------------------------------------------------------
    def export(self, out: Path) -> None:
        state = full_state_dict(self.engine, self.cfg.learner.zero_stage)
        if self.mode != "rm":
            export_hf(self.engine, self.cfg.model.path, out, state, self.cfg.model.lora)
            return
        if self.rank == 0:
            from safetensors.torch import save_file

            base = {k.removeprefix("base."): v for k, v in state.items() if k.startswith("base.")}
            self.engine.module.base.save_pretrained(out, state_dict=base)
            self.tok.save_pretrained(out)
            save_file(
                {k.removeprefix("head."): v.contiguous() for k, v in state.items() if k[:5] == "head."},
                out / REWARD_HEAD,
            )
            chat = {"chat_template": self.cfg.data.chat_template, "system_prompt": self.cfg.data.system_prompt}
            (out / SETTINGS).write_text(json.dumps(chat))
        dist.barrier()


class Progress:
    """Rank 0's records (``metrics.jsonl``, ``tensorboard/``) and progress lines; nothing on other ranks."""

    def __init__(self, mode: str, steps: int, run_dir: Path, rank: int, start: int):
        self.mode, self.steps, self.start, self.started = mode, steps, start, time.time()
        self.sinks = None
        if rank == 0:
            self.sinks = Sinks(JsonlSink(run_dir / "metrics.jsonl"), TensorBoardSink(run_dir / "tensorboard"))

    def say(self, text: str) -> None:
        if self.sinks is not None:
            print(f"[{self.mode}] {text}", flush=True)

    def step(self, step: int, metrics: dict[str, float], evals: dict[str, float]) -> None:
        if self.sinks is None:
            return
        if metrics:
            self.sinks.log({"time": time.time(), "learner/version": step, **metrics})
        if evals:
            self.sinks.log({"time": time.time(), "eval/version": step, **evals})
        shown = " ".join(
            f"{k.removeprefix('learner/')}={v:.4g}" for k, v in {**metrics, **evals}.items() if k[-2:] != "_s"
        )
        eta = (time.time() - self.started) / max(1, step - self.start) * (self.steps - step)
        self.say(f"step {step}/{self.steps} {shown} (eta {eta:.0f}s)")

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()


def run(cfg: OfflineConfig, mode: str, run_dir: Path) -> None:
    ckpt_dir, every = run_dir / "checkpoint", cfg.run.eval_every or cfg.run.steps
    with starting_up():  # the collector's passes left for the end of set-up (asyncrl.lifetime)
        trainer = Trainer(cfg, mode, dist.get_rank(), dist.get_world_size())
        restored = load_committed(trainer.engine, ckpt_dir)  # after DPO's reference pass: the initial policy's
    start = 0 if restored is None else restored[0]
    progress = Progress(mode, cfg.run.steps, run_dir, trainer.rank, start)
    if restored is not None:
        progress.say(f"resumed at step {start} from {ckpt_dir}")
    try:
        if trainer.eval and start == 0:
            progress.step(0, {}, trainer.evaluate())
        for step in range(start + 1, cfg.run.steps + 1):
            metrics = trainer.train_step(step - 1)
            if commit_due(cfg.learner, step, cfg.run.steps):
                save_checkpoint(trainer.engine, ckpt_dir, step, {})
            due = trainer.eval and (step % every == 0 or step == cfg.run.steps)
            progress.step(step, metrics, trainer.evaluate() if due else {})
        if cfg.learner.checkpoint:
            save_checkpoint(trainer.engine, ckpt_dir, cfg.run.steps, {})
            trainer.export(run_dir / "export")
            progress.say(f"exported to {run_dir / 'export'}")
    finally:
        progress.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="asyncrl offline training rank (started by asyncrl sft/rm/dpo)")
    ap.add_argument("--mode", required=True, choices=("sft", "rm", "dpo"))
    ap.add_argument("--config", required=True, help="the run directory's config.yaml")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, schema=OfflineConfig)
    rank = int(os.environ["RANK"])
    setup_logging(cfg.run_dir / f"rank-{rank}.log", name=f"{args.mode}-{rank}")
    torch.set_num_threads(int(os.environ.get("ASYNCRL_TORCH_THREADS", "1")))
    torch.manual_seed(cfg.run.seed)
    hide_triton_without_cuda()
    init_distributed(cfg.learner.backend)
    try:
        run(cfg, args.mode, cfg.run_dir)
    finally:
        dist.destroy_process_group()
    exit_after_collectives()  # reached only when the run ended well; an error above exits as usual


if __name__ == "__main__":
    main()
