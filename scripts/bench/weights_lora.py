"""``scripts/bench/weights.py --lora`` (see its doc): a LoRA adapter's versions against the full model's,
through that script's subscriber processes, each applying what it gets as a generator does."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch


def lora_states(path: str, rank: int) -> tuple[dict, dict, float]:
    """(the model's full state dict, a rank ``rank`` adapter of it with B random, alpha / rank)."""
    from transformers import AutoModelForCausalLM

    from asyncrl.config import LoraConfig
    from asyncrl.learners.lora import adapter_state, with_lora
    from asyncrl.weights.ties import untied

    model = AutoModelForCausalLM.from_pretrained(path)
    full = {k: v.detach().clone() for k, v in untied(model).items()}
    lora = LoraConfig(rank=rank, alpha=2.0 * rank)
    wrapped = with_lora(model, lora)
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.01)
    return full, adapter_state(wrapped), lora.alpha / lora.rank


def lora_main(args, harness) -> None:
    """Full and adapter versions through ``harness`` (``weights.py``): its ``Subscribers`` and ``run_case``,
    every subscriber applying what it gets (``--apply``), adapters merged."""
    path = str(Path(args.lora_model).resolve())
    full, adapter, scale = lora_states(path, args.lora_rank)
    sizes = {label: sum(t.nbytes for t in s.values()) for label, s in (("full", full), ("adapter", adapter))}
    print(f"{path}: full {sizes['full'] / 1e6:.1f} MB, rank {args.lora_rank} adapter {sizes['adapter'] / 1e6:.2f} MB")
    args.apply, args.transports = True, "zmq"
    groups = [int(x) for x in args.groups.split(",")]
    subs = harness.Subscribers(max(groups), [None] * max(groups), args.secret)
    times: dict = {}
    try:
        with tempfile.TemporaryDirectory(prefix="wbench", dir="/tmp") as tmp:
            for r in range(args.rounds):
                for label, state in (("full", full), ("adapter", adapter)):
                    args.adapter = [path, scale] if label == "adapter" else None
                    for g in groups:
                        s, _ = harness.run_case(subs, state, "zmq", g, args, tmp, "127.0.0.1")
                        times.setdefault((label, g), []).append(s)
                        print(f"round {r} {label:>7} G={g}: {s:.3f}s publish to applied", flush=True)
    finally:
        subs.close()
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"RESULT lora_bytes_ratio {sizes['adapter'] / sizes['full']:.4f}")
    print(f"RESULT lora_sync_ratio {median['adapter', groups[0]] / median['full', groups[0]]:.3f}")
    if 8 in groups:
        print(f"RESULT lora_sync_g8_ratio {median['adapter', 8] / median['full', 8]:.3f}")
