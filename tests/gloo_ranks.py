"""Run one test function on several gloo ranks, each in a spawned process, meeting as the learner ranks do
(``learners.engine.init_distributed``). A failed check in any rank fails the test with that rank's traceback."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.learners.engine import init_distributed


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
    # Every check has passed. Skip the interpreter's finalisation: a gloo worker thread that drops its last
    # finished work after the main thread moved on takes the GIL to free the work's tensors, is ended by
    # Py_Finalize's pthread_exit inside a noexcept destructor, and the rank dies of SIGABRT ("terminate called
    # without an active exception"; seen 1 run in 4 here, the core's thread 1 in ProcessGroupGloo::runLoop).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(fn: Callable[..., None], world: int, *args) -> None:
    """``fn(rank, *args)`` on ``world`` ranks; ``fn`` must be a module-level function (spawn imports it)."""
    mp.spawn(_rank, args=(_free_port(), world, fn, args), nprocs=world, join=True)
