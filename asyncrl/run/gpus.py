"""Which GPU each process of a local launch gets (``asyncrl launch`` on one host; Ray places its actors by
their ``num_gpus``, SLURM by the job's GRES).

Learner rank r sees every GPU and takes the r-th (``learners.deepspeed_engine`` sets the device from LOCAL_RANK), so
the first L GPUs are the learners'. Each generator sees one GPU (``CUDA_VISIBLE_DEVICES``): one of those after
the learners', round robin, or, where none is left, one of the learners' (they then share it, as vLLM takes a
fixed fraction of its memory). Before this, every generator ran on the first GPU.

NCCL refuses two ranks of one communicator on one GPU (measured on an H200 with NCCL 2.28, two processes on
one GPU: the group does not form). Two groups are NCCL's here: the learner ranks (``learner.backend`` nccl,
the default on GPUs) and, with ``weights.type=nccl``, learner rank 0 with every generator. A layout that puts
two members of one group on one GPU is refused before anything starts, in one line; such a run used to stall
at its first weight version with nothing said.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config import Config
from asyncrl.errors import UserError

NVIDIA = Path("/proc/driver/nvidia")


def has_driver() -> bool:
    """Whether this host has an NVIDIA driver, without importing torch (seconds): it exposes /proc/driver/nvidia."""
    return (NVIDIA / "version").exists()


def visible_gpus() -> list[str]:
    """This host's GPUs as a child's ``CUDA_VISIBLE_DEVICES`` names them: the launcher's own list where it has
    one, else the driver's GPUs by index. Without importing torch where the driver lists them."""
    if not has_driver():
        return []
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is not None:
        gpus = []
        for name in (part.strip() for part in named.split(",")):
            if not name or name.startswith("-"):  # CUDA stops at the first invalid entry
                break
            gpus.append(name)
        return gpus
    if (NVIDIA / "gpus").is_dir():
        return [str(i) for i in range(len(list((NVIDIA / "gpus").iterdir())))]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


@dataclass(frozen=True)
class GpuPlan:
    learners: list[str]  # local learner rank r's GPU
    generators: list[str]  # generator i's GPU, its CUDA_VISIBLE_DEVICES

    def generator_env(self, i: int) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": self.generators[i % len(self.generators)]} if self.generators else {}


def plan_gpus(cfg: Config, gpus: list[str]) -> GpuPlan:
    """The GPU of every local process of ``cfg``'s run on a host with ``gpus`` (none: no GPU is named).
    Raises UserError for a layout NCCL refuses (the module's doc)."""
    if not gpus:
        return GpuPlan([], [])
    n, local, generators = len(gpus), cfg.run.learners - cfg.run.remote_learners, cfg.run.generators
    if local > n:
        raise UserError(
            f"{local} learner ranks on this host need a GPU each and it has {n} "
            f"(CUDA_VISIBLE_DEVICES={','.join(gpus)}): use --learners {n} or fewer"
        )
    free = gpus[local:] or gpus
    plan = GpuPlan(learners=gpus[:local], generators=[free[i % len(free)] for i in range(generators)])
    if cfg.weights.type == "nccl":
        members = plan.learners[:1] + plan.generators  # learner rank 0 publishes to every generator
        if len(set(members)) < len(members):
            more = f", or at most {n - local} generators" if n > local else ", or a host with more GPUs"
            raise UserError(
                f"weights.type=nccl needs learner rank 0 and every generator on a GPU of its own (NCCL refuses two "
                f"ranks on one GPU): {generators} generators and {local} learner ranks on {n} GPUs here; use "
                f"weights.type=shm (one host){more}"
            )
    return plan
