"""``learner``: the DeepSpeed ranks' optimizer, batch, memory and checkpoint settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.config.base import Section


class LearnerConfig(Section):
    groups_per_step: int = Field(8, ge=1, description="B: trajectory groups per optimizer step, summed over ranks.")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    minibatches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per batch: each rank's groups are cut into this many mini-batches "
        "(whole groups; groups_per_step / run.learners must be divisible by it). Above 1, the PPO clip "
        "against pi_prox and the critic's value clip bind; 1 = one step on the whole batch.",
    )
    epochs: int = Field(1, ge=1, description="Passes over each batch's mini-batches (PPO epochs).")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate (AdamW).")
    lr_final_ratio: float = Field(
        0.1, ge=0, le=1, description="Cosine decay to lr * this at the last step (a constant high lr oscillates late)."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    router_aux_loss_coef: float = Field(
        0.0,
        ge=0,
        description="A mixture of experts: this times the router's load-balancing loss (Switch Transformer's, "
        "1.0 when balanced: learner/moe_aux_loss) is added to the policy loss; 0 = reported only.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in backward (HF gradient checkpointing) instead "
        "of keeping them: activation memory drops to the layers' inputs, a step costs about one more forward.",
    )
    jemalloc: bool = Field(
        True,
        description="Launched learner ranks run on jemalloc when the system has it (apt libjemalloc2, "
        "which scripts/setup.sh installs), returning freed pages after 2 s (MALLOC_CONF, unless set), else on "
        "glibc's malloc: glibc keeps the memory a step frees (SmolLM2-135M, ZeRO 0: peak 4.80 -> 3.82 GB, "
        "3.38 -> 2.84 with activation checkpointing; scripts/bench/memory.py --allocator both).",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend: auto = nccl on GPU, gloo on CPU."
    )
    checkpoint: bool = Field(True, description="Write a DeepSpeed checkpoint and an HF export at the end.")
    checkpoint_every: int = Field(
        10,
        ge=0,
        description="Commit a checkpoint every this many steps (0: only at the end). Trained groups are "
        "acknowledged in the buffer only when a checkpoint that includes them is committed; a restarted "
        "learner resumes from the last one.",
    )
    max_restarts: int = Field(
        1, ge=0, description="Restarts of the learner ranks (from the last committed checkpoint) before the run fails."
    )
    start_timeout_s: float = Field(
        300.0,
        gt=0,
        description="When the learner ranks are not up (the first version published) this long after they "
        "started, the launcher says in one line what each still waits for (the run goes on waiting: "
        "run.timeout_s ends it).",
    )
