"""The learner ranks' rendezvous listens on MASTER_ADDR only (issue 11, defect 6): torch's env:// store
listened on every interface, unauthenticated, whatever MASTER_ADDR said."""

from __future__ import annotations

import os
import socket

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.learners.engine import init_distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, world: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(GLOO_SOCKET_IFNAME="lo")  # what the launcher sets for a local run
    init_distributed("gloo")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    listening = [c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN]
    dist.barrier()  # every rank has looked while all of them are up
    out.put((rank, float(total), listening))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_meet_and_listen_on_loopback_only():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port, world = _free_port(), 2
    procs = [ctx.Process(target=_rank, args=(r, port, world, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [total for _, total, _ in results] == [3.0, 3.0]  # the group works
    rank0_listens = results[0][2]
    assert "127.0.0.1" in rank0_listens  # the store
    for rank, _, listening in results:
        assert all(ip.startswith("127.") or ip == "::1" for ip in listening), (rank, listening)
