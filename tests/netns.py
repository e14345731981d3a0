"""A network namespace joined to this one by a veth pair: "another host" on one machine.

Processes started with ``ip netns exec <name>`` have their own loopback and one address
(``inner``); they reach this namespace only over TCP at ``outer``. Addresses are taken from
10.231.0.0/16, in a /30 no interface here uses; everything is deleted on exit, also on error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest


@dataclasses.dataclass(frozen=True)
class Namespace:
    name: str
    outer: str  # this namespace's end of the veth pair
    inner: str  # the namespace's end

    def cmd(self, *argv: str) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def require_netns() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")


@contextlib.contextmanager
def namespace(tag: str) -> Iterator[Namespace]:
    require_netns()
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=10).stdout
    block = next(b for b in range(os.getpid() % 64, 256) if f"10.231.{b}." not in used)
    name, veth = f"asyncrl-{tag}-{os.getpid()}", f"arl{os.getpid() % 100000}"
    ns = Namespace(name, outer=f"10.231.{block}.1", inner=f"10.231.{block}.2")
    try:
        _ip("netns", "add", name)
        _ip("link", "add", f"{veth}o", "type", "veth", "peer", "name", f"{veth}i")
        _ip("link", "set", f"{veth}i", "netns", name)
        _ip("addr", "add", f"{ns.outer}/30", "dev", f"{veth}o")
        _ip("link", "set", f"{veth}o", "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{ns.inner}/30", "dev", f"{veth}i")
        _ip("netns", "exec", name, "ip", "link", "set", f"{veth}i", "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield ns
    finally:
        subprocess.run(["ip", "link", "del", f"{veth}o"], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
