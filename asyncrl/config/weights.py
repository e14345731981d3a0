"""``weights``: the weight bus from learner rank 0 to the generators, chosen by its ``type`` alone (zmq, shm,
nccl; memory, the in-process stub of tests)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from asyncrl.config.base import Section, type_or


class _WeightsBase(Section):
    bucket_mb: int = Field(
        64,
        ge=1,
        description="Bucket size of the bucketed state dict (MiB). A zmq relay chain uses at most 8 MiB (its "
        "pipeline is as deep as a version has buckets).",
    )


class ZmqWeightsConfig(_WeightsBase):
    type: Literal["zmq"] = Field("zmq", description="ZeroMQ from learner rank 0 to generators (tcp/ipc, any host).")
    relay: bool = Field(
        False,
        description="Generators relay each version's buckets to one another (a pipelined chain), so the "
        "publisher sends it about once whatever the fleet size; false: the publisher sends it to every one.",
    )
    delta: bool = Field(
        True,
        description="Send a version as what changed since the one before it (bit-exact, verified whole) to every "
        "generator that holds that one, when that is at most delta_max_ratio of the bytes: bfloat16 runs, where few "
        "elements change per step; float32 runs, where nearly all do, keep sending full versions and say why "
        "(weights/full_reason). A relay passes a delta on to those behind it that hold its base, and makes the full "
        "version for any other.",
    )
    delta_max_ratio: float = Field(
        0.5, gt=0, le=1, description="A delta goes only when its bytes are at most this fraction of the full version's."
    )
    full_every: int = Field(
        50,
        ge=0,
        description="With deltas, a full version to everyone at least every this many versions (0: only to "
        "generators that join, restart, miss or fail to verify one).",
    )


class ShmWeightsConfig(_WeightsBase):
    type: Literal["shm"] = Field(
        "shm",
        description="Same host only: each version is written once to shared memory and mapped by every generator.",
    )
    dir: str = Field(
        "/dev/shm",
        min_length=1,
        description="tmpfs directory for the versions; needs room for about three versions "
        "(Docker's default /dev/shm is 64 MB: raise --shm-size).",
    )
    verify: Literal["structure", "full"] = Field(
        "structure",
        description="What each generator checks. structure: header, manifest, sizes and extents, O(tensors); the "
        "bytes were hashed once by the publisher. full: also re-hash every byte in every generator, O(bytes) each.",
    )


class NcclWeightsConfig(_WeightsBase):
    type: Literal["nccl"] = Field(
        "nccl",
        description="CUDA only: buckets broadcast GPU to GPU over a process group of learner rank 0 and the "
        "generators, re-formed whenever one joins or leaves.",
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="The longest a group formation or one bucket's broadcast may take; a dead or stopped generator "
        "stalls the others for about this long before the group is re-formed without it.",
    )

    @model_validator(mode="after")
    def _needs_cuda(self) -> NcclWeightsConfig:
        import torch  # only here: importing the config must stay cheap

        if not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
            raise ValueError(
                "weights.type=nccl needs CUDA GPUs and a torch build with NCCL; "
                "this machine has none: use weights.type=zmq (any host) or shm (same host)"
            )
        return self


class MemoryWeightsConfig(_WeightsBase):
    type: Literal["memory"] = Field(
        "memory", description="In-process stub (tests): publisher and subscribers share one process."
    )


WeightsConfig = Annotated[
    Annotated[ZmqWeightsConfig, Tag("zmq")]
    | Annotated[ShmWeightsConfig, Tag("shm")]
    | Annotated[NcclWeightsConfig, Tag("nccl")]
    | Annotated[MemoryWeightsConfig, Tag("memory")],
    Discriminator(type_or("zmq")),
]
