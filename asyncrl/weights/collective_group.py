"""The collective bus's process groups: one per membership epoch, built for weight transfer only
(never the default group, which the learner's DeepSpeed owns), meeting on a ``TCPStore`` that the
publisher hosts. Rank 0 is the publisher, ranks 1..world-1 the members in join order.

Store keys (under the publisher's store): ``asyncrl.weights/e<epoch>/arrived/<rank>`` is set by a
member told its rank for that epoch, before it builds its end; the group itself uses the prefix
``asyncrl.weights/e<epoch>/``.

NCCL specifics (gloo is what the CPU tests run, same code): every rank of a group needs a GPU of
its own (NCCL refuses two ranks on one device). The communicator of an epoch is made lazily by its
first broadcast, which blocks until every member has called it; a member that dies in that instant
(after reporting for the epoch) can hold it longer than ``timeout_s``. A stuck broadcast is
aborted by us after ``timeout_s``, before NCCL's own watchdog (set to 2 x ``timeout_s`` + 30 s)
would tear the process down.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

# Sleep between completion checks of a running collective (cheap; keeps close() responsive).
_SPIN_S = 0.0005
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class Group:
    """One epoch's process group (rank 0 = publisher); built directly, never registered with
    ``torch.distributed``'s default group or group registry."""

    def __init__(self, backend: str, store, epoch: int, rank: int, world: int, host: str | None, timeout_s: float):
        self.epoch, self.rank, self.world = epoch, rank, world
        prefix = dist.PrefixStore(f"asyncrl.weights/e{epoch}/", store)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = datetime.timedelta(seconds=timeout_s)
            gloo = dist.ProcessGroupGloo
            opts._devices = [gloo.create_device(hostname=host) if host else gloo.create_default_device()]
            self.pg = gloo(prefix, rank, world, opts)  # rendezvous: returns when all ranks connected
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            # Longer than our own deadline: we abort a stuck group before NCCL's watchdog would.
            opts._timeout = datetime.timedelta(seconds=2 * timeout_s + 30)
            self.pg = dist.ProcessGroupNCCL(prefix, rank, world, opts)  # communicator made on first use
        else:
            raise ValueError(f"unknown collective backend {backend!r}")

    def broadcast(self, tensor: torch.Tensor, timeout_s: float, stop: Callable[[], bool]) -> None:
        """Broadcast ``tensor`` from rank 0; raises on failure, after ``timeout_s``, or once ``stop()``."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        work = self.pg.broadcast([tensor], opts)
        try:
            deadline = time.monotonic() + timeout_s
            while not work.is_completed():
                if stop():
                    raise RuntimeError("closing")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"broadcast of {tensor.numel()} bytes took over {timeout_s}s")
                time.sleep(_SPIN_S)
            work.wait()  # raises the collective's error; on CUDA orders the current stream after it
        finally:
            del work  # a traceback kept in a log record must not keep the group's connections alive

    def close(self) -> None:
        try:
            self.pg.abort()
        except Exception:  # noqa: BLE001 - best effort: a group may be half made or already failed
            pass
        self.pg = None


def arrived_key(epoch: int, rank: int) -> str:
    return f"asyncrl.weights/e{epoch}/arrived/{rank}"


def resolve_device(device: str | torch.device) -> torch.device:
    """``cuda`` means the caller's current GPU, fixed now: the background thread starts on cuda:0."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def split_tcp(address: str) -> tuple[str, int]:
    parts = urlsplit(address)
    if parts.scheme != "tcp" or not parts.hostname:
        raise ValueError(f"the collective weight bus needs a tcp:// control address, not {address!r}")
    return parts.hostname, parts.port or 0


def gloo_host(host: str) -> str | None:
    """Interface for gloo: loopback stays loopback; otherwise gloo's default (GLOO_SOCKET_IFNAME)."""
    return "127.0.0.1" if host in LOOPBACK else None
