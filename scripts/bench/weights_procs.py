"""The weight bench's subscriber processes (``weights.py --child``), driven over JSON lines on their stdin and
stdout, and the bare libzmq publisher and subscriber that measure the floor under the zmq bus."""

from __future__ import annotations

import ctypes
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import zmq

from asyncrl.weights import (
    RelayWeightSubscriber,
    ShmWeightSubscriber,
    ZmqWeightSubscriber,
)
from asyncrl.weights.lora import base_state, is_adapter, merge
from asyncrl.weights.wire import snapshot


# --- the floor of the zmq transport -----------------------------------------------------------------
class RawZmqPublisher:
    """The same buckets through a bare PUSH socket: no manifest, checksums or copies (measured only
    for G = 1). Its time is what libzmq itself costs on this machine, the floor under our zmq bus."""

    def __init__(self, address: str, bucket_bytes: int) -> None:
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.bind(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.bucket_bytes = bucket_bytes
        self._buckets: list | None = None

    def publish(self, version: int, state: dict) -> None:
        if self._buckets is None:
            self._buckets = snapshot(version, state, self.bucket_bytes).buckets
        self._sock.send_multipart([str(version).encode(), *self._buckets], copy=False)

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        self._sock.close(linger=0)


class RawZmqSubscriber:
    def __init__(self, address: str) -> None:
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.connect(address)

    def poll(self, timeout_ms: int):
        if not self._sock.poll(timeout_ms):
            return None
        # the bytes alone: no manifest, so nothing sent or verified to report
        frames = self._sock.recv_multipart(copy=False)
        return SimpleNamespace(version=int(frames[0].bytes), tensors={}, sent={}, checksum=None)

    def close(self) -> None:
        self._sock.close(linger=0)


# --- subscriber processes ---------------------------------------------------------------------------
def subscriber_main(index: int) -> None:
    """Commands, one JSON list a line on stdin: ["sub", transport, address, verify, apply, adapter],
    ["unsub"], ["exit"]; each is answered [command, index] on stdout, and every version its poll
    returns is reported ["got", index, version, perf_counter]. The secret, if any, is in
    ``ASYNCRL_SECRET``."""
    die_with_parent()
    torch.set_num_threads(1)
    secret = os.environ.get("ASYNCRL_SECRET") or None
    commands: queue.Queue = queue.Queue()

    def read_commands() -> None:
        for line in sys.stdin:
            commands.put(json.loads(line))
        commands.put(["exit"])  # the bench is gone (its end of the pipe closed): so is this subscriber

    threading.Thread(target=read_commands, daemon=True).start()

    def say(*msg) -> None:
        print(json.dumps(msg), flush=True)

    sub, apply, params, base, scale = None, False, {}, None, 1.0
    while True:
        if sub is None or not commands.empty():
            cmd = commands.get(timeout=600)
            if sub is not None:
                sub.close()
                sub = None
            if cmd[0] == "exit":
                return
            if cmd[0] == "sub":
                _, transport, address, verify, apply, adapter = cmd
                if adapter is not None and base is None:  # [model dir, scale]: versions are adapters
                    base, scale = base_state(adapter[0]), adapter[1]
                sub = make_subscriber(transport, address, index, verify, secret)
            say(cmd[0], index)
            continue
        update = sub.poll(timeout_ms=20)
        if update is None:
            continue
        if apply:
            apply_version(update.tensors, params, base, scale)
        sent = update.sent
        say("got", index, update.version, time.perf_counter(), time.process_time(), sent, update.checksum)
        del update  # an shm version's file is reusable once no process maps it


def die_with_parent() -> None:
    """The kernel kills this process when the bench dies, however it dies (the OOM killer's SIGKILL
    included): a subscriber holding a version must not outlive it (Linux ``PR_SET_PDEATHSIG``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the bench died before the prctl
        os._exit(1)


def apply_version(tensors: dict, params: dict, base: dict | None, scale: float) -> None:
    """Copy a version into ``params`` (made at the first); an adapter is merged into ``base`` first, as a
    generator applies one (asyncrl.weights.lora)."""
    if is_adapter(tensors):
        tensors = {**base, **merge(base, tensors, scale)}
    for name, t in tensors.items():
        if name not in params:
            params[name] = torch.empty_like(t)
        params[name].copy_(t)


def make_subscriber(transport: str, address: str, index: int, verify: str, secret: str | None):
    if transport == "shm":
        return ShmWeightSubscriber(address, f"bench{index}", verify=verify)
    if transport == "zmq-raw":
        return RawZmqSubscriber(address)
    if transport == "zmq-relay":
        return RelayWeightSubscriber(address, f"bench{index}", secret=secret)
    return ZmqWeightSubscriber(address, f"bench{index}", secret=secret)


class Subscribers:
    """``n`` subscriber processes (this script with ``--child``), each inside ``netns[i]`` if that
    is a namespace name; commands and reports travel as JSON lines (never pickle)."""

    def __init__(self, n: int, netns: list[str | None], secret: str | None) -> None:
        env = {k: v for k, v in os.environ.items() if k != "ASYNCRL_SECRET"}
        if secret:
            env["ASYNCRL_SECRET"] = secret
        self.procs: list[subprocess.Popen] = []
        self.received: dict[int, tuple[dict, str]] = {}  # index -> (update.sent, checksum) of its last arrival
        for i in range(n):
            prefix = ["ip", "netns", "exec", netns[i]] if netns[i] else []
            cmd = [*prefix, sys.executable, str(Path(__file__).with_name("weights.py")), "--child", str(i)]
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True))

    def _send(self, i: int, cmd: list) -> None:
        self.procs[i].stdin.write(json.dumps(cmd) + "\n")
        self.procs[i].stdin.flush()

    def _recv(self, i: int, timeout_s: float) -> list:
        out = self.procs[i].stdout
        if not select.select([out], [], [], timeout_s)[0]:
            raise TimeoutError(f"subscriber {i} silent for {timeout_s:.0f}s")
        line = out.readline()
        if not line:
            raise RuntimeError(f"subscriber {i} exited")
        return json.loads(line)

    def command(self, g: int, cmd: list, timeout_s: float = 120.0) -> None:
        for i in range(g):
            self._send(i, cmd)
        for i in range(g):
            while (reply := self._recv(i, timeout_s))[0] == "got":
                pass  # a report of a version nobody waits for any more
            assert reply[0] == cmd[0], reply

    def arrivals(self, g: int, version: int, timeout_s: float = 300.0) -> dict[int, tuple[float, float]]:
        """Subscriber index -> (perf_counter, its process's CPU seconds) when ``version`` arrived."""
        got: dict[int, tuple[float, float]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < g:
            outs = {self.procs[i].stdout: i for i in range(g) if i not in got}
            ready, _, _ = select.select(list(outs), [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"version {version}: {len(got)} of {g} subscribers reported")
            for out in ready:
                kind, index, v, t, cpu, sent, checksum = self._recv(outs[out], 1.0)
                if v == version:
                    got[index] = (t, cpu)
                    self.received[index] = (sent, checksum)
        return got

    def close(self) -> None:
        for i in range(len(self.procs)):
            try:
                self._send(i, ["exit"])
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()  # our own child, by handle
                proc.wait(timeout=10)
