"""Weight bus: learner rank 0 publishes each policy version; generators poll for the newest one.

Invariants (what generators rely on):
- ``poll`` returns only complete versions whose bucket sizes, bucket checksums and whole
  ``state_dict_checksum`` verified; a half-received or corrupted version is never visible (a bad
  one is logged, counted in ``subscriber.rejected``, and the previous version stays current).
  Over shm the bytes are hashed once, by the publisher, unless ``verify="full"`` (see ``shm_bus``).
- Versions only move forward: ``poll`` returns the newest available version newer than the last one
  it returned, skipping older queued ones.
- A subscriber that joins late gets the newest version at once, not at the next learner step.
- ``publish`` costs the caller one copy of the state dict; a slow, stalled or dead subscriber never
  blocks it, and at most a few versions are held in memory whatever the subscribers do.

Transports, chosen by ``weights.type``: ZeroMQ (``zmq``: ``tcp://host:port`` or ``ipc://path``;
with ``weights.relay`` the subscribers pass versions on to one another, see ``relay_bus``, else
the publisher sends to each, see ``zmq_bus``; both CURVE-authenticated over tcp with the run
secret, see ``curve``), same-host shared memory (``shm``: ``shm://<dir>``, see ``shm_bus``) and
GPU-to-GPU broadcast (``nccl``: a ``tcp://`` control address, see ``collective_bus``); the two
socket transports share one control plane (``control_plane``). ``MemoryWeightBus``
(``weights.type: memory``, ``memory://name``) is the in-process stub. The transport is chosen by the
section's ``type`` alone; an address in another transport's scheme is an error. The wire format is
documented in ``wire``.

May import: the core.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.net import is_loopback

if TYPE_CHECKING:
    from asyncrl.weights.base import WeightPublisher, WeightSubscriber
    from asyncrl.weights.collective_bus import CollectiveWeightPublisher
    from asyncrl.weights.collective_subscriber import CollectiveWeightSubscriber
    from asyncrl.weights.memory import MemoryWeightBus, MemoryWeightPublisher, MemoryWeightSubscriber
    from asyncrl.weights.relay_bus import RelayWeightPublisher
    from asyncrl.weights.relay_subscriber import RelayWeightSubscriber
    from asyncrl.weights.shm_bus import ShmWeightPublisher, ShmWeightSubscriber
    from asyncrl.weights.shm_reclaim import remove_stale_shm
    from asyncrl.weights.wire import (
        WIRE_HEADER,
        WeightsRejected,
        WeightUpdate,
        decode,
        encode,
        state_dict_checksum,
    )
    from asyncrl.weights.zmq_bus import ZmqWeightPublisher, ZmqWeightSubscriber

# name -> the submodule that defines it, imported on first use (PEP 562): the transports import torch
# (seconds), and a process that only reclaims shared memory (the launcher) or picks an address never needs it
_LAZY = {
    "WeightPublisher": "base",
    "WeightSubscriber": "base",
    "CollectiveWeightPublisher": "collective_bus",
    "CollectiveWeightSubscriber": "collective_subscriber",
    "MemoryWeightBus": "memory",
    "MemoryWeightPublisher": "memory",
    "MemoryWeightSubscriber": "memory",
    "RelayWeightPublisher": "relay_bus",
    "RelayWeightSubscriber": "relay_subscriber",
    "ShmWeightPublisher": "shm_bus",
    "ShmWeightSubscriber": "shm_bus",
    "remove_stale_shm": "shm_reclaim",
    "WIRE_HEADER": "wire",
    "WeightsRejected": "wire",
    "WeightUpdate": "wire",
    "decode": "wire",
    "encode": "wire",
    "state_dict_checksum": "wire",
    "ZmqWeightPublisher": "zmq_bus",
    "ZmqWeightSubscriber": "zmq_bus",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # looked up once
    return value


__all__ = [
    "CollectiveWeightPublisher",
    "CollectiveWeightSubscriber",
    "WIRE_HEADER",
    "MemoryWeightBus",
    "MemoryWeightPublisher",
    "MemoryWeightSubscriber",
    "RelayWeightPublisher",
    "RelayWeightSubscriber",
    "ShmWeightPublisher",
    "ShmWeightSubscriber",
    "WeightPublisher",
    "WeightSubscriber",
    "WeightUpdate",
    "WeightsRejected",
    "bus_address",
    "ZmqWeightPublisher",
    "ZmqWeightSubscriber",
    "decode",
    "encode",
    "private_address",
    "remove_stale_shm",
    "setup_publisher",
    "setup_subscriber",
    "state_dict_checksum",
]

DEFAULT_ADDRESS = "tcp://127.0.0.1:*"
_SUN_PATH_MAX = 107  # bytes of a unix socket path (sockaddr_un.sun_path is 108 with its NUL)


def private_address(weights, directory: Path) -> str | None:
    """The endpoint a run's publisher binds so that only its own user's processes can read the weights.

    zmq: an ipc socket in ``directory`` (the run directory, mode 0700: the kernel refuses every other
    user's connect; over loopback tcp any local user could subscribe). A path too long for a unix
    socket falls back to one 0700 directory per run directory under the system temp dir, reused by
    restarts, and refused if it is not this user's alone. shm makes its own 0700 directory; nccl's
    control plane is tcp (GPU hosts) and gets the default (None).
    """
    if weights.type != "zmq":
        return None
    directory = Path(directory).resolve()
    path = directory / "weights.sock"
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        digest = hashlib.sha256(os.fsencode(directory)).hexdigest()[:16]
        short = Path(tempfile.gettempdir()) / f"asyncrl-ipc-{os.getuid()}-{digest}"
        short.mkdir(mode=0o700, exist_ok=True)
        st = short.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
            raise PermissionError(f"{short} exists but is not a 0700 directory of this user")
        path = short / "weights.sock"
    return f"ipc://{path}"


def bus_address(weights, host: str, directory: Path) -> str | None:
    """What the run's publisher binds: on loopback hosts the private endpoint of
    :func:`private_address`; for a run that other hosts join (``run.host``), a tcp port on that
    address (the socket transports authenticate both ends with the run's secret there)."""
    if is_loopback(host) or weights.type == "shm":
        return private_address(weights, directory)
    return f"tcp://{host}:*"


def setup_publisher(weights, address: str | None = None, secret: str | None = None) -> WeightPublisher:
    """The publisher of the transport that ``weights.type`` names (``asyncrl.config``'s weights section).

    ``address`` is what to bind, in that transport's scheme: zmq and nccl ``tcp://127.0.0.1:*`` (default:
    loopback, a free port), ``tcp://0.0.0.0:PORT`` for generators on other hosts or zmq's ``ipc:///path``;
    shm ``shm://<tmpfs dir>`` (default ``shm://`` + ``weights.dir``), under which the publisher makes its
    own directory; memory ``memory://name``. An address of another scheme is an error naming both.
    ``publisher.address`` is the resolved endpoint to hand to subscribers. ``secret`` (the run secret, 64
    hex digits) makes a tcp endpoint admit only subscribers that hold it, and encrypts it (zmq, and nccl's
    control plane: see ``curve``); shm and memory ignore it.
    """
    bucket_bytes = weights.bucket_mb << 20
    address = address or (f"shm://{weights.dir}" if weights.type == "shm" else None)
    _check_scheme(weights.type, address)
    if weights.type == "memory":
        from asyncrl.weights.memory import MemoryWeightBus

        return MemoryWeightBus.get(address or "memory://default", create=True, bucket_bytes=bucket_bytes).publisher()
    if weights.type == "shm":
        from asyncrl.weights.shm_bus import ShmWeightPublisher

        return ShmWeightPublisher(address.removeprefix("shm://"), bucket_bytes=bucket_bytes)
    if weights.type == "zmq":
        from asyncrl.weights.delta import DeltaPolicy

        deltas = DeltaPolicy(weights.full_every, weights.delta_max_ratio) if weights.delta else None
        if weights.relay:
            from asyncrl.weights.relay_bus import RelayWeightPublisher as cls
        else:
            from asyncrl.weights.zmq_bus import ZmqWeightPublisher as cls
        return cls(address or DEFAULT_ADDRESS, bucket_bytes=bucket_bytes, secret=secret, deltas=deltas)
    if weights.type == "nccl":
        from asyncrl.weights.collective_bus import CollectiveWeightPublisher

        return CollectiveWeightPublisher(
            address or DEFAULT_ADDRESS,
            backend="nccl",
            device=_current_cuda_device(),
            bucket_bytes=bucket_bytes,
            timeout_s=weights.timeout_s,
            secret=secret,
        )
    raise ValueError(f"unknown weights type {weights.type!r}")


def setup_subscriber(
    weights, address: str, subscriber_id: str, have: int = -1, secret: str | None = None
) -> WeightSubscriber:
    """A subscriber of the publisher at ``address``, of the transport ``weights.type`` names; ``have`` is the
    version already loaded (e.g. 0 when the engine started from the initial weights), so only newer ones are
    delivered. ``secret`` must be the publisher's: over tcp, a subscriber without it (or with another)
    receives nothing, and accepts nothing from a publisher without it."""
    _check_scheme(weights.type, address)
    if weights.type == "memory":
        from asyncrl.weights.memory import MemoryWeightBus

        return MemoryWeightBus.get(address).subscriber(subscriber_id, have)
    if weights.type == "shm":
        from asyncrl.weights.shm_bus import ShmWeightSubscriber

        return ShmWeightSubscriber(address, subscriber_id, have, verify=weights.verify)
    if weights.type == "zmq":
        if weights.relay:
            from asyncrl.weights.relay_subscriber import RelayWeightSubscriber

            return RelayWeightSubscriber(address, subscriber_id, have, secret=secret)
        from asyncrl.weights.zmq_bus import ZmqWeightSubscriber

        return ZmqWeightSubscriber(address, subscriber_id, have, secret=secret)
    if weights.type == "nccl":
        from asyncrl.weights.collective_subscriber import CollectiveWeightSubscriber

        return CollectiveWeightSubscriber(
            address,
            subscriber_id,
            have,
            backend="nccl",
            device=_current_cuda_device(),
            timeout_s=weights.timeout_s,
            secret=secret,
        )
    raise ValueError(f"unknown weights type {weights.type!r}")


# The address schemes each transport speaks: the transport is chosen by weights.type, never by an address.
SCHEMES = {"zmq": ("tcp", "ipc"), "nccl": ("tcp",), "shm": ("shm",), "memory": ("memory",)}


def _check_scheme(kind: str, address: str | None) -> None:
    scheme = address.partition("://")[0] if address else None
    if scheme is not None and scheme not in SCHEMES.get(kind, ()):
        wanted = " or ".join(f"{s}://" for s in SCHEMES.get(kind, ()))
        raise ValueError(f"weights.type={kind} speaks {wanted}, not {address!r}")


def _current_cuda_device():
    """This process's CUDA device (``torch.cuda.set_device`` / LOCAL_RANK decide which), for nccl."""
    import torch

    return torch.device("cuda", torch.cuda.current_device())
