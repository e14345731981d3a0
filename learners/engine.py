"""DeepSpeed plumbing for a learner rank: engine set-up, full weights, checkpoint and HF export.

All functions that gather ZeRO-3 partitions are collectives: every rank must call them.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl.config import Config


def init_distributed(cfg: Config) -> None:
    backend = cfg.learner.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def lr_lambda(cfg: Config):
    """Linear warm-up, then cosine decay to ``lr_final_ratio`` at the last step."""
    steps, warmup, final = cfg.run.steps, cfg.learner.warmup_steps, cfg.learner.lr_final_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_engine(cfg: Config):
    import deepspeed
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,  # we feed whole per-rank batches ourselves
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.learner.grad_clip,
        "zero_optimization": {"stage": cfg.learner.zero_stage},
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "fp16": {"enabled": cfg.model.dtype == "float16"},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, dist_init_required=False
    )
    return engine


def full_state_dict(engine, zero_stage: int) -> dict[str, torch.Tensor] | None:
    """The complete HF state dict on rank 0 (None elsewhere). A collective under ZeRO-3."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=zero_stage == 3):
        if dist.get_rank() != 0:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in engine.module.state_dict().items()}


def save_final(engine, cfg: Config, run_dir: Path, state_dict: dict | None, version: int) -> None:
    """DeepSpeed checkpoint (all ranks) and, on rank 0, an HF export that transformers and vLLM load."""
    engine.save_checkpoint(str(run_dir / "checkpoint"), tag=f"version-{version}")
    if dist.get_rank() == 0 and state_dict is not None:
        from transformers import AutoTokenizer

        export = run_dir / "export"
        engine.module.save_pretrained(export, state_dict=state_dict)
        AutoTokenizer.from_pretrained(cfg.model.path).save_pretrained(export)
    dist.barrier()
