"""DeepSpeed plumbing for a learner rank: engine set-up, full weights, checkpoints and HF export.

All functions that gather ZeRO-3 partitions or save checkpoints are collectives: every rank must
call them.

Checkpoints live in ``<run>/checkpoint/version-<v>/`` (DeepSpeed's files plus each rank's
``asyncrl-rank<r>.json``: the buffer entries it holds and how often each was trained). A checkpoint
is *committed* when the marker of ``learners.checkpoint`` names it; it is written (atomically, by rank
0) only after every rank saved, and a restarted learner resumes from it, nothing else.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import shutil
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl.config import LearnerConfig, ModelConfig
from asyncrl.learners.batching import add_head_grad_in_place
from asyncrl.learners.checkpoint import read_committed, room_shortfall, write_committed
from asyncrl.learners.lora import adapter_state, base_model, merged_state, with_lora
from asyncrl.learners.ops import load_cpu_op
from asyncrl.learners.peak_memory import accumulate_tied_lookup_in_place, enable_activation_checkpointing
from asyncrl.models.vision import causal_lm_class, freeze_vision, is_vision_model
from asyncrl.rundir import write_atomic
from asyncrl.weights.ties import untied


def hide_triton_without_cuda() -> None:
    """Without CUDA, ``import triton`` fails in this process from now on. Triton is installed (vLLM's
    structured output needs it) but compiles GPU kernels only; transformers' model imports reach torch's
    dynamo, which imports it only to ask whether it is there: 96 MB of a CPU learner's resident memory."""
    if not torch.cuda.is_available():
        sys.modules.setdefault("triton", None)


def init_distributed(backend: str, phase: Callable[[str], None] = lambda what: None) -> None:
    """Join the learner ranks' default process group; ``backend`` auto = nccl on GPU, gloo on CPU. On CPU,
    DeepSpeed's shared-memory op is built first if need be (``asyncrl.learners.ops``); ``phase(what)`` is
    told what the rank waits for.

    Rendezvous through ``MASTER_ADDR:MASTER_PORT`` (the launcher's environment). torch's own env://
    rendezvous makes rank 0's TCPStore listen on every interface, unauthenticated, whatever
    MASTER_ADDR says; here rank 0 listens on MASTER_ADDR only (loopback for a local run).
    """
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        load_cpu_op(phase)  # DeepSpeed's comm backend then takes it from its cache
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    phase(f"meeting the learner ranks ({world} in all) at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    store = rendezvous_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


_STORE_SOCKETS: list[socket.socket] = []  # rank 0's listening socket lives as long as its store


def rendezvous_store(addr: str, port: int, rank: int, world: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """The process group's key-value store: rank 0 serves it on ``addr:port`` (that address only),
    the other ranks connect to it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(addr, port, world, False, timeout)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, port))
    sock.listen(128)
    _STORE_SOCKETS.append(sock)
    return dist.TCPStore(addr, port, world, True, timeout, master_listen_fd=sock.fileno())


def lr_lambda(learner: LearnerConfig, steps: int):
    """Linear warm-up, then cosine decay to ``lr_final_ratio`` at version ``steps``. Counted in batches
    (policy versions): the optimizer steps of one batch (``minibatches`` x ``epochs``) share its lr."""
    warmup, final = learner.warmup_steps, learner.lr_final_ratio
    per_batch = learner.minibatches * learner.epochs

    def factor(optimizer_step: int) -> float:
        step = optimizer_step // per_batch
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_engine(learner: LearnerConfig, model_cfg: ModelConfig, steps: int, model=None, lr: float | None = None):
    """A DeepSpeed engine with AdamW + schedule around ``model`` (default: the policy at ``model.path``);
    ``steps`` is the run's last version (the schedule's end)."""
    import deepspeed

    if model is None:
        model = causal_lm_class(model_cfg.path).from_pretrained(model_cfg.path, dtype=getattr(torch, model_cfg.dtype))
        if model_cfg.freeze_vision:  # a vision-language model's tower and connector stay as loaded
            freeze_vision(model)
        if model_cfg.lora is not None:  # the policy trains an adapter only (learners.lora)
            model = with_lora(model, model_cfg.lora)
    plain_grads = learner.zero_stage == 0 and model_cfg.dtype == "float32"  # nothing hooks their accumulation
    if learner.activation_checkpointing:
        enable_activation_checkpointing(model, by_rows=plain_grads)
    if plain_grads:
        accumulate_tied_lookup_in_place(model)
        add_head_grad_in_place(model)
    lr = learner.lr if lr is None else lr
    # fused: one kernel per tensor, no temporaries (the unfused CPU loop allocates two of the embedding's
    # size for the second-moment denominator, 226 MB on SmolLM2-135M), and faster
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=learner.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(learner, steps))
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,  # we feed whole per-rank batches ourselves
        "gradient_accumulation_steps": 1,
        "gradient_clipping": learner.grad_clip,
        "zero_optimization": {"stage": learner.zero_stage},
        "bf16": {"enabled": model_cfg.dtype == "bfloat16"},
        "fp16": {"enabled": model_cfg.dtype == "float16"},
        "steps_per_print": 10**9,
    }
    # DeepSpeed's ZeRO set-up imports its Muon optimizer, whose kernels are torch.compile'd as the module
    # loads: with inductor, the default backend, that import costs ~0.6 s more of a core per rank start, for
    # functions an AdamW run never calls. Only while it runs: the default is put back after.
    set_backend = getattr(torch.compiler, "set_default_backend", None)
    if set_backend is not None:
        set_backend("eager")
    try:
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, dist_init_required=False
        )
    finally:
        if set_backend is not None:
            set_backend(None)
    if learner.zero_stage == 0 and dist.get_world_size() == 1:
        # ZeRO 0 all-reduces every gradient through one flat copy of all of them (a 500M-element bucket:
        # one more gradient's worth of memory at the end of backward); over one rank it is the identity
        engine.enable_backward_allreduce = False
    return engine


def full_state_dict(engine, zero_stage: int, keep: set[str] | None = None) -> dict[str, torch.Tensor] | None:
    """A version's tensors on rank 0 (None elsewhere): the complete HF state dict, each tied tensor once
    (under the first of its names, see ``asyncrl.weights.ties``), or a LoRA policy's adapter alone
    (``learners.lora``); ``keep``: only these names (a VLM's language model, its vision frozen). A collective
    under ZeRO-3."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=zero_stage == 3):
        if dist.get_rank() != 0:
            return None
        if base_model(engine.module) is not engine.module:
            return adapter_state(engine.module)
        state = untied(engine.module).items()
        return {k: v.detach().to("cpu", copy=True) for k, v in state if keep is None or k in keep}


def commit_due(learner: LearnerConfig, version: int, steps: int) -> bool:
    """Whether a checkpoint is committed after the step that made ``version`` (the last one always is)."""
    every = learner.checkpoint_every
    return every > 0 and version % every == 0 and version < steps


CRITIC_TAG = "critic"  # a critic engine's files: <run>/checkpoint/version-<v>/critic/


def save_checkpoint(engine, ckpt_dir: Path, version: int, rank_state: dict, critic=None) -> None:
    """Save every rank's part of version ``version`` (policy, and critic if any) and commit it; older
    checkpoints are removed. A save the disk cannot hold fails here, uncommitted: the committed one stays,
    and the launcher removes the partial one (``learners.checkpoint``); rank 0 warns first."""
    rank = dist.get_rank()
    tag = f"version-{version}"
    shortfall = room_shortfall(ckpt_dir) if rank == 0 else None
    if shortfall is not None:
        logging.getLogger("asyncrl.learner").warning("checkpoint of version %d: %s", version, shortfall)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False)
    if critic is not None:
        critic.save_checkpoint(str(ckpt_dir / tag), tag=CRITIC_TAG, save_latest=False)
    (ckpt_dir / tag).mkdir(parents=True, exist_ok=True)
    write_atomic(ckpt_dir / tag / f"asyncrl-rank{rank}.json", json.dumps(rank_state))
    dist.barrier()  # every rank's files are on disk before the commit names them
    if rank == 0:
        write_committed(ckpt_dir, version, tag)
        for old in ckpt_dir.glob("version-*"):
            if old.name != tag:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_committed(engine, ckpt_dir: Path, critic=None) -> tuple[int, dict] | None:
    """Restore the committed checkpoint (policy, and critic if any): (its version, this rank's saved
    state), or None if none."""
    committed = read_committed(ckpt_dir)
    if committed is None:
        return None
    path, _ = engine.load_checkpoint(str(ckpt_dir), tag=committed["tag"])
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the committed checkpoint {ckpt_dir / committed['tag']}")
    if critic is not None:
        path, _ = critic.load_checkpoint(str(ckpt_dir / committed["tag"]), tag=CRITIC_TAG)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the critic of {ckpt_dir / committed['tag']}")
    state_file = ckpt_dir / committed["tag"] / f"asyncrl-rank{dist.get_rank()}.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    return committed["version"], state


def export_hf(engine, model_path: str, export: Path, state_dict: dict | None, lora=None) -> None:
    """On rank 0, an HF export of ``state_dict`` (with ``model_path``'s tokenizer) that transformers and
    vLLM load; for a LoRA policy (``lora``: its ``model.lora``) the merged model, and the adapter as peft
    saves it in ``export/adapter``."""
    import deepspeed
    from transformers import AutoProcessor, AutoTokenizer

    if lora is not None:
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
            if dist.get_rank() == 0:
                base_model(engine.module).save_pretrained(export, state_dict=merged_state(engine.module, lora))
                engine.module.save_pretrained(export / "adapter")
    elif dist.get_rank() == 0 and state_dict is not None:
        engine.module.save_pretrained(export, state_dict=state_dict)
    if dist.get_rank() == 0:
        AutoTokenizer.from_pretrained(model_path).save_pretrained(export)
        if is_vision_model(model_path):  # and a vision-language model's processor (image settings, chat template)
            AutoProcessor.from_pretrained(model_path).save_pretrained(export)
    dist.barrier()
