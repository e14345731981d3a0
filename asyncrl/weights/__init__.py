"""Weight bus: learner rank 0 publishes each policy version; generators poll for the newest one.

Invariants (what generators rely on):
- ``poll`` returns only complete versions whose bucket sizes, bucket checksums and whole
  ``state_dict_checksum`` verified; a half-received or corrupted version is never visible (a bad
  one is logged, counted in ``subscriber.rejected``, and the previous version stays current).
  Over shm the bytes are hashed once, by the publisher, unless ``shm_verify="full"`` (below).
- Versions only move forward: ``poll`` returns the newest available version newer than the last one
  it returned, skipping older queued ones.
- A subscriber that joins late gets the newest version at once, not at the next learner step.
- ``publish`` costs the caller one copy of the state dict; a slow, stalled or dead subscriber never
  blocks it, and at most a few versions are held in memory whatever the subscribers do.

Transports: ZeroMQ (``tcp://host:port`` or ``ipc://path``, see ``zmq_bus``), same-host shared
memory (``shm://<dir>``, see ``shm_bus``), GPU-to-GPU NCCL broadcast (``transport="nccl"``, a
``tcp://`` control address, see ``collective_bus``) and the in-process stub ``MemoryWeightBus``
(``memory://name``). The wire format is documented in ``wire``.

With shm a version is written once to a tmpfs file that every generator maps: its tensors are
read-shared views of that file (a write into one changes only that process's copy), and by default
(``WeightsConfig.shm_verify="structure"``) the bytes are hashed once by the publisher, not again by
each generator, whose check is O(tensors); ``shm_bus`` explains why. A launcher calls
``remove_stale_shm`` at the end of a run for publishers that were killed before they could clean up.
"""

from __future__ import annotations

from asyncrl.weights.base import WeightPublisher, WeightSubscriber
from asyncrl.weights.collective_bus import CollectiveWeightPublisher, CollectiveWeightSubscriber
from asyncrl.weights.memory import MemoryWeightBus, MemoryWeightPublisher, MemoryWeightSubscriber
from asyncrl.weights.shm_bus import ShmWeightPublisher, ShmWeightSubscriber, remove_stale_shm
from asyncrl.weights.wire import (
    WIRE_HEADER,
    WeightsRejected,
    WeightUpdate,
    decode,
    encode,
    state_dict_checksum,
)
from asyncrl.weights.zmq_bus import ZmqWeightPublisher, ZmqWeightSubscriber

__all__ = [
    "CollectiveWeightPublisher",
    "CollectiveWeightSubscriber",
    "WIRE_HEADER",
    "MemoryWeightBus",
    "MemoryWeightPublisher",
    "MemoryWeightSubscriber",
    "ShmWeightPublisher",
    "ShmWeightSubscriber",
    "WeightPublisher",
    "WeightSubscriber",
    "WeightUpdate",
    "WeightsRejected",
    "ZmqWeightPublisher",
    "ZmqWeightSubscriber",
    "decode",
    "encode",
    "remove_stale_shm",
    "setup_publisher",
    "setup_subscriber",
    "state_dict_checksum",
]

DEFAULT_ADDRESS = "tcp://127.0.0.1:*"


def setup_publisher(cfg_weights, address: str | None = None) -> WeightPublisher:
    """The publisher for ``cfg_weights`` (``asyncrl.config.WeightsConfig``).

    ``address`` is what to bind: ``tcp://127.0.0.1:*`` (default: loopback, random free port),
    ``tcp://0.0.0.0:PORT`` for generators on other hosts, ``ipc:///path``, or ``memory://name``
    for the in-process stub. With ``transport="shm"`` (or an ``shm://`` address) it is
    ``shm://<tmpfs dir>`` (default ``shm://`` + ``cfg_weights.shm_dir``), under which the publisher
    makes its own directory. ``publisher.address`` is the resolved endpoint to hand to subscribers.
    """
    bucket_bytes = cfg_weights.bucket_mb << 20
    if address and address.startswith("memory://"):
        return MemoryWeightBus.get(address, create=True, bucket_bytes=bucket_bytes).publisher()
    if (address and address.startswith("shm://")) or cfg_weights.transport == "shm":
        if address and not address.startswith("shm://"):
            raise ValueError(f"weights.transport=shm binds shm://<tmpfs dir>, not {address!r}")
        root = address.removeprefix("shm://") if address else cfg_weights.shm_dir
        return ShmWeightPublisher(root, bucket_bytes=bucket_bytes)
    if cfg_weights.transport == "zmq":
        return ZmqWeightPublisher(address or DEFAULT_ADDRESS, bucket_bytes=bucket_bytes)
    if cfg_weights.transport == "nccl":
        return CollectiveWeightPublisher(
            address or DEFAULT_ADDRESS,
            backend="nccl",
            device=_current_cuda_device(),
            bucket_bytes=bucket_bytes,
            timeout_s=cfg_weights.collective_timeout_s,
        )
    raise ValueError(f"unknown weights transport {cfg_weights.transport!r}")


def setup_subscriber(cfg_weights, address: str, subscriber_id: str, have: int = -1) -> WeightSubscriber:
    """A subscriber of the publisher at ``address``; ``have`` is the version already loaded
    (e.g. 0 when the engine started from the initial weights), so only newer ones are delivered."""
    if address.startswith("memory://"):
        return MemoryWeightBus.get(address).subscriber(subscriber_id, have)
    if address.startswith("shm://"):
        return ShmWeightSubscriber(address, subscriber_id, have, verify=cfg_weights.shm_verify)
    if cfg_weights.transport == "zmq":
        return ZmqWeightSubscriber(address, subscriber_id, have)
    if cfg_weights.transport == "nccl":
        return CollectiveWeightSubscriber(
            address,
            subscriber_id,
            have,
            backend="nccl",
            device=_current_cuda_device(),
            timeout_s=cfg_weights.collective_timeout_s,
        )
    raise ValueError(f"unknown weights transport {cfg_weights.transport!r}")


def _current_cuda_device():
    """This process's CUDA device (``torch.cuda.set_device`` / LOCAL_RANK decide which), for nccl."""
    import torch

    return torch.device("cuda", torch.cuda.current_device())
