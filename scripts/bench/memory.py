"""Learner memory and step time: one learner step (``train_step.train_step``) on a real HF model.

Each rank is a process started as the launcher starts learners (``RANK``/``WORLD_SIZE``/``MASTER_*``,
gloo, ``learners.deepspeed_engine.init_distributed``), one torch thread, the demo config's GRPO
(``configs/demo-cpu.yaml``), a synthetic batch of ``--sequences`` sequences (over all ranks, as
``learner.groups_per_step`` counts them) of ``--prompt`` + ``--response`` tokens. Peak RSS is the
kernel's high-water mark (``VmHWM``) of each rank over its whole life: imports, model load, engine
set-up and ``--steps`` steps. The parameter bytes are the model's unique float32 parameter bytes
(tied embeddings counted once), whatever ``model.dtype`` is.

    .venv/bin/python scripts/bench/memory.py --allocator both --checkpointing on   # SmolLM2-135M, ZeRO 0 f32
    RESULT system_learner_peak_rss_gb 3.292      # measured on 2 shared cores (docs/models.md's tables)
    RESULT jemalloc_learner_peak_rss_gb 2.902
    RESULT jemalloc_over_system_peak_rss 0.882
    RESULT jemalloc_over_system_step_seconds 0.920

``--config FILE`` measures that run config's learner on its own step: its model, its algorithm and learner
settings, ``groups_per_step`` x ``n_samples`` sequences of its training prompts' median length (rendered as
its generators render them) + ``max_new_tokens``:

    .venv/bin/python scripts/bench/memory.py --config configs/smollm2-arith.yaml [--checkpointing on]

``--table`` runs ZeRO 0/2/3 x float32/bfloat16 x activation checkpointing off/on (ZeRO 2/3 on
``--ranks`` ranks) one after the other on one ``--allocator`` (default jemalloc, as launched learners
run) and prints a markdown table and one RESULT line per cell.
Timings are wall-clock on whatever else the machine runs: noisy, compare within one session.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GB = 1e9


def rss_bytes(field: str = "VmHWM") -> int:
    """This process's resident set (``VmRSS``) or its high-water mark (``VmHWM``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def synthetic_groups(sequences: int, per_group: int, prompt: int, response: int, vocab: int, rank: int):
    """This rank's share of ``sequences`` sequences, as groups of ``per_group`` samples."""
    import numpy as np

    from asyncrl.protocol import Sample, TrajectoryGroup

    rng = np.random.default_rng(rank)
    groups = []
    for g in range(sequences // per_group):
        samples = [
            Sample(
                rng.integers(3, vocab, response).astype(np.int32),
                rng.uniform(-3.0, -0.1, response).astype(np.float32),
                np.zeros(response, np.int32),
                float(rng.integers(0, 2)),
            )
            for _ in range(per_group)
        ]
        groups.append(TrajectoryGroup(rng.integers(3, vocab, prompt).astype(np.int32), samples, g, 0, "bench"))
    return groups


def worker(args: argparse.Namespace) -> None:
    """One learner rank: build the models as ``trainer.run`` does, take the steps, print one JSON line."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    from asyncrl.config import load_config
    from asyncrl.learners.batching import make_batch
    from asyncrl.learners.deepspeed_engine import hide_triton_without_cuda, init_distributed
    from asyncrl.learners.train_step import ScoredSampling, build_models, train_step

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hide_triton_without_cuda()  # as trainer.serve does
    init_distributed("gloo")
    rss_imported = rss_bytes("VmRSS")
    overrides = {
        "model.path": args.model,
        "model.dtype": args.dtype,
        "learner.zero_stage": args.zero,
        "learner.groups_per_step": args.sequences // args.per_group,
        "generator.n_samples": args.per_group,
        "generator.max_new_tokens": args.response,
        **dict(kv.split("=", 1) for kv in args.set),
    }
    cfg = load_config(args.config or str(ROOT / "configs/demo-cpu.yaml"), overrides)
    models = build_models(cfg.learner, cfg.model, cfg.algorithm, cfg.run.steps)
    module = models.policy.module
    vocab = module.config.vocab_size
    param_bytes = 4 * sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in module.parameters())
    rss_built = rss_bytes("VmRSS")
    groups = synthetic_groups(args.sequences // world, args.per_group, args.prompt, args.response, vocab, rank)
    batch = make_batch(groups, args.response, cfg.algorithm.preset, pad_id=0, version=0)
    sampling = ScoredSampling(cfg.generator.temperature, args.response)
    seconds, cpu_seconds = [], []
    for _ in range(args.steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        out, _ = train_step(models, batch, cfg.algorithm.preset, cfg.learner, sampling, world)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    record = {
        "rank": rank,
        "peak_rss": rss_bytes("VmHWM"),
        "rss_imported": rss_imported,
        "rss_built": rss_built,
        "rss_end": rss_bytes("VmRSS"),
        "param_bytes": param_bytes,
        "step_seconds": seconds,
        "step_cpu_seconds": cpu_seconds,
        "loss": float(out.policy_loss),
    }
    print("WORKER " + json.dumps(record), flush=True)
    torch.distributed.destroy_process_group()


def shape_of(args: argparse.Namespace) -> None:
    """Fill in the flags left unset: from ``--config`` (its model and step shape) where given, else the
    defaults (SmolLM2-135M, 16 sequences of 30 + 30 tokens in groups of 8)."""
    defaults = {"model": ".cache/models/smollm2-135m-instruct", "sequences": 16, "per_group": 8, "prompt": 30}
    defaults["response"] = 30
    if args.config is not None:
        from transformers import AutoTokenizer

        from asyncrl.chat import ChatTokens
        from asyncrl.config import load_config
        from asyncrl.data import prompt_of
        from asyncrl.data.sources import PromptSet

        cfg = load_config(args.config)
        gen, ep = cfg.generator, cfg.episode
        chat = ChatTokens(
            AutoTokenizer.from_pretrained(cfg.model.path), use_template=ep.chat_template, system_prompt=ep.system_prompt
        )
        lengths = sorted(len(chat.prompt_ids(prompt_of(r))) for r in PromptSet(cfg.data.train_sources[0]).head(256))
        defaults.update(model=cfg.model.path, per_group=gen.n_samples, response=gen.max_new_tokens)
        defaults.update(sequences=cfg.learner.groups_per_step * gen.n_samples, prompt=lengths[len(lengths) // 2])
        if args.checkpointing is None:
            args.checkpointing = "on" if cfg.learner.activation_checkpointing else "off"
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    print(
        f"{args.model}: {args.sequences} sequences of {args.prompt} + {args.response} tokens a step, groups of "
        f"{args.per_group}, checkpointing {args.checkpointing or 'as configs/demo-cpu.yaml'}",
        file=sys.stderr,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args: argparse.Namespace, zero: int, dtype: str, checkpointing: bool | None, allocator: str) -> dict:
    """Start ``ranks`` worker processes for one configuration on ``allocator`` (jemalloc or glibc's
    malloc: ``system``); their records, summarised."""
    ranks = 1 if zero == 0 else args.ranks
    port = str(free_port())
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--zero", str(zero), "--dtype", dtype]
    cmd += ["--config", args.config] if args.config else []
    cmd += ["--steps", str(args.steps), "--sequences", str(args.sequences), "--per-group", str(args.per_group)]
    cmd += ["--prompt", str(args.prompt), "--response", str(args.response)]
    sets = list(args.set)
    if checkpointing is not None:
        sets.append(f"learner.activation_checkpointing={str(checkpointing).lower()}")
    cmd += [x for s in sets for x in ("--set", s)]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(ranks), DS_ACCELERATOR="cpu")
    env.update(GLOO_SOCKET_IFNAME="lo", ASYNCRL_TORCH_THREADS="1", OMP_NUM_THREADS="1")
    if allocator == "jemalloc":  # as the launcher starts learners (learner.jemalloc)
        from asyncrl.lifetime import jemalloc_env

        env = jemalloc_env(env)
        if env is None:
            sys.exit("--allocator jemalloc: no libjemalloc.so.2 on this system (apt install libjemalloc2)")
    procs = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for r in range(ranks)
    ]
    records = []
    for p in procs:
        stdout, stderr = p.communicate()
        lines = [ln for ln in stdout.decode().splitlines() if ln.startswith("WORKER ")]
        if p.returncode != 0 or not lines:
            sys.exit(f"rank failed ({p.returncode}):\n{stderr.decode()[-3000:]}")
        records.append(json.loads(lines[-1][len("WORKER ") :]))

    def median_after_first(key: str) -> float:  # the first step also builds Adam's state; the slowest rank
        timed = [r[key][1:] or r[key] for r in records]
        return max(sorted(t)[len(t) // 2] for t in timed)

    return {
        "allocator": allocator,
        "zero": zero,
        "dtype": dtype,
        "checkpointing": checkpointing,
        "ranks": ranks,
        "peak_rss_gb": max(r["peak_rss"] for r in records) / GB,
        "peak_over_params": max(r["peak_rss"] for r in records) / records[0]["param_bytes"],
        "rss_built_gb": max(r["rss_built"] for r in records) / GB,
        "rss_imported_gb": max(r["rss_imported"] for r in records) / GB,
        "step_seconds": median_after_first("step_seconds"),
        "step_cpu_seconds": median_after_first("step_cpu_seconds"),
        "first_step_seconds": max(r["step_seconds"][0] for r in records),
        "loss": records[0]["loss"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--config",
        help="measure this run config's learner: its model, algorithm and learner settings, and its step's shape "
        "(groups_per_step x n_samples sequences of max_new_tokens after its training prompts' median length) "
        "unless flags below say otherwise (default: configs/demo-cpu.yaml's settings on --model)",
    )
    ap.add_argument("--model", help="HF model directory (default: the config's, else SmolLM2-135M's recipe directory)")
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--checkpointing", choices=["on", "off"], help="learner.activation_checkpointing (default: config)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks for ZeRO stages above 0 (ZeRO 0 runs one rank)")
    ap.add_argument("--steps", type=int, default=3, help="learner steps; the first is not timed")
    ap.add_argument("--sequences", type=int, help="sequences per step over all ranks (default 16)")
    ap.add_argument("--per-group", type=int, help="samples per group (generator.n_samples; default 8)")
    ap.add_argument("--prompt", type=int, help="prompt tokens (default 30)")
    ap.add_argument("--response", type=int, help="response tokens (default 30)")
    ap.add_argument("--set", action="append", default=[], help="extra config override key=value")
    ap.add_argument("--table", action="store_true", help="ZeRO 0/2/3 x float32/bfloat16 x checkpointing off/on")
    ap.add_argument(
        "--allocator",
        default="jemalloc",
        choices=["jemalloc", "system", "both"],
        help="the ranks' malloc: jemalloc (as launched learners, learner.jemalloc), glibc's (system), or both "
        "side by side (RESULT <allocator>_... lines and their ratios)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    shape_of(args)
    if not args.table:
        ckpt = None if args.checkpointing is None else args.checkpointing == "on"
        both = args.allocator == "both"
        runs = {}
        for allocator in ("system", "jemalloc") if both else (args.allocator,):
            r = runs[allocator] = measure(args, args.zero, args.dtype, ckpt, allocator)
            print(json.dumps(r), file=sys.stderr)
            name = f"{allocator}_" if both else ""
            print(f"RESULT {name}learner_peak_rss_gb {r['peak_rss_gb']:.3f}")
            print(f"RESULT {name}peak_rss_over_param_bytes {r['peak_over_params']:.2f}")
            print(f"RESULT {name}step_seconds {r['step_seconds']:.2f}")
            print(f"RESULT {name}step_cpu_seconds {r['step_cpu_seconds']:.2f}")
        if both:
            je, sys_ = runs["jemalloc"], runs["system"]
            print(f"RESULT jemalloc_over_system_peak_rss {je['peak_rss_gb'] / sys_['peak_rss_gb']:.3f}")
            print(f"RESULT jemalloc_over_system_step_seconds {je['step_seconds'] / sys_['step_seconds']:.3f}")
        return
    if args.allocator == "both":
        ap.error("--table measures one allocator: pass --allocator jemalloc or system")
    print(
        "| ZeRO | ranks | dtype | checkpointing | peak RSS / rank (GB) | peak / param bytes | step s | first step s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for zero, dtype, ckpt in itertools.product((0, 2, 3), ("float32", "bfloat16"), (False, True)):
        r = measure(args, zero, dtype, ckpt, args.allocator)
        name = f"zero{zero}_{dtype}_ckpt{'on' if ckpt else 'off'}"
        print(
            f"| {zero} | {r['ranks']} | {dtype} | {'on' if ckpt else 'off'} | {r['peak_rss_gb']:.2f} | "
            f"{r['peak_over_params']:.2f} | {r['step_seconds']:.2f} | {r['first_step_seconds']:.2f} |",
            flush=True,
        )
        print(f"RESULT {name}_peak_rss_gb {r['peak_rss_gb']:.3f}", file=sys.stderr)
        print(f"RESULT {name}_step_seconds {r['step_seconds']:.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()
