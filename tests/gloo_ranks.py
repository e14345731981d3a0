"""Run one test function on several gloo ranks, each in a spawned process, meeting as the learner ranks do
(``learners.deepspeed_engine.init_distributed``). A failed check in any rank fails the test with that rank's
traceback."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.learners.deepspeed_engine import init_distributed
from asyncrl.lifetime import exit_after_collectives


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, world: int, fn: Callable[..., None], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(GLOO_SOCKET_IFNAME="lo")  # what the launcher sets for a local run
    init_distributed("gloo")
    fn(rank, *args)
    dist.barrier()  # neither rank tears gloo down while the other still talks to it
    dist.destroy_process_group()
    exit_after_collectives()  # every check has passed


def run_on_ranks(fn: Callable[..., None], world: int, *args) -> None:
    """``fn(rank, *args)`` on ``world`` ranks; ``fn`` must be a module-level function (spawn imports it)."""
    mp.spawn(_rank, args=(_free_port(), world, fn, args), nprocs=world, join=True)
