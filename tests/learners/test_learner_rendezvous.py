"""The learner ranks' rendezvous listens on MASTER_ADDR only (issue 11, defect 6): torch's env:// store
listened on every interface, unauthenticated, whatever MASTER_ADDR said."""

from __future__ import annotations

import psutil
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_on_ranks


def _rank(rank: int) -> None:
    # run_on_ranks meets through learners.deepspeed_engine.init_distributed with MASTER_ADDR=127.0.0.1
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    assert float(total) == 3.0  # the group works
    listening = [c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN]
    dist.barrier()  # every rank has looked while all of them are up
    if rank == 0:
        assert "127.0.0.1" in listening  # the store
    assert all(ip.startswith("127.") or ip == "::1" for ip in listening), (rank, listening)


@pytest.mark.slow
def test_two_ranks_meet_and_listen_on_loopback_only():
    run_on_ranks(_rank, 2)
