"""Push and pop throughput of the Redis buffer against raw redis-py on the same server.

Starts a private redis-server the way the launcher does (AOF on, ``appendfsync always``: every
write is on disk before its reply), except that automatic AOF rewrites are off unless ``--aof-rewrite``
(a rewrite forks a child that takes a CPU for about half a second, which on a 2-core machine swung
whichever side it landed on by 2x). Builds ``--groups`` realistic trajectory groups (``--samples``
x ``--tokens`` response tokens with float32 log-probs and int32 versions, plus a
``--prompt-tokens`` prompt: about 100 KB each) and encodes them once, outside the timed regions.

* ours: ``RedisBuffer.push`` per group (one round trip: MULTI, XADD, EVAL of the dedup-and-count
  script, EXEC); pop is ``read`` of ``--batch`` groups (XREADGROUP) and ``ack(..., "trained")``
  (one EVALSHA: XACK, XDEL, count); a fresh run prefix each round;
* raw: the same bytes under the same field names with a plain redis-py client. Push per call is one
  XADD and one round trip per group, as ours is; it is the push ratio's denominator because a
  generator pushes each group as it finishes (ours has nothing to pipeline), so the fair question
  is what dedup and counting cost over the bare command. Push pipelined (``--pipeline`` XADDs per
  round trip) is shown as a ceiling only. Pop is XREADGROUP of ``--batch``, then XACK + XDEL of the
  ids pipelined in one round trip: two round trips per batch, as ours.

Each of ``--rounds`` rounds pushes every group through each variant, then pops them, alternating
between the variants every ``--chunk`` groups (the order flips each chunk), so a burst of load
from elsewhere, or the AOF's once-a-second fsync, hits all of them alike. Per round, a variant's
rate is its groups over the sum of its chunks' wall times; medians over rounds are reported, with
redis-server's CPU time per group (``INFO cpu``, all its threads). Encode and decode rates
(``asyncrl.protocol``) are printed for information. redis-benchmark, if installed, adds XADD of a
payload of the same size from one C client, to show the Python client's share of the cost::

    .venv/bin/python scripts/bench/buffer.py --rounds 3
    RESULT push_ratio <ours push groups/s / raw per-call push groups/s>
    RESULT pop_ratio <ours pop groups/s / raw pop groups/s>
"""

from __future__ import annotations

import argparse
import collections
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import redis

from asyncrl.buffers import run_prefix
from asyncrl.buffers.redis_buffer import RedisBuffer
from asyncrl.fleet.redis_server import start_redis_server
from asyncrl.protocol import Sample, TrajectoryGroup, decode_group, encode_group

GROUP = "learners"
Frames = list[tuple[str, bytes]]
Step = Callable[[Frames], object]  # pushes these frames, or pops as many groups


def make_groups(n: int, samples: int, tokens: int, prompt_tokens: int) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(0)

    def sample() -> Sample:
        return Sample(
            tokens=rng.integers(0, 150_000, tokens, dtype=np.int32),
            logprobs=-rng.exponential(1.0, tokens).astype(np.float32),
            versions=np.sort(rng.integers(40, 43, tokens, dtype=np.int32)),
            reward=float(rng.random()),
        )

    return [
        TrajectoryGroup(
            prompt_ids=rng.integers(0, 150_000, prompt_tokens, dtype=np.int32),
            samples=[sample() for _ in range(samples)],
            prompt_index=i,
            epoch=0,
            producer="bench",
        )
        for i in range(n)
    ]


class Ours:
    """The buffer under test, under a fresh run prefix."""

    def __init__(self, url: str, batch: int):
        self.buf, self.batch = RedisBuffer(url, run_prefix(f"bench-{uuid.uuid4().hex[:8]}")), batch

    def push(self, frames: Frames) -> None:
        assert all(self.buf.push(gid, frame, producer="bench") for gid, frame in frames)

    def pop(self, frames: Frames) -> None:
        left = len(frames)
        while left:
            entries = self.buf.read("rank0", min(self.batch, left), block_ms=0)
            assert entries, f"{left} groups missing"
            left -= self.buf.ack(entries, "trained")

    def close(self, n: int) -> None:
        stats = self.buf.stats()
        self.buf.close()
        assert stats["pushed"] == stats["trained"] == n and stats["queued"] == stats["pending"] == 0, stats


class Raw:
    """Bare stream commands with redis-py on fresh keys (one for per-call, one for pipelined pushes)."""

    def __init__(self, client: redis.Redis, batch: int, pipeline: int):
        self.r, self.batch, self.pipeline = client, batch, pipeline
        self.key, self.piped_key = f"bench-raw:{uuid.uuid4().hex}", f"bench-raw-piped:{uuid.uuid4().hex}"
        client.xgroup_create(self.key, GROUP, id="0", mkstream=True)

    def push(self, frames: Frames) -> None:
        for gid, frame in frames:
            self.r.xadd(self.key, {"gid": gid, "producer": "bench", "frame": frame})

    def push_pipelined(self, frames: Frames) -> None:
        for i in range(0, len(frames), self.pipeline):
            pipe = self.r.pipeline(transaction=False)
            for gid, frame in frames[i : i + self.pipeline]:
                pipe.xadd(self.piped_key, {"gid": gid, "producer": "bench", "frame": frame})
            pipe.execute()

    def pop(self, frames: Frames) -> None:
        left = len(frames)
        while left:
            reply = self.r.xreadgroup(GROUP, "rank0", {self.key: ">"}, count=min(self.batch, left))
            ids = [eid for _, entries in reply for eid, _ in entries]
            assert ids, f"{left} groups missing"
            pipe = self.r.pipeline(transaction=False)
            pipe.xack(self.key, GROUP, *ids)
            pipe.xdel(self.key, *ids)
            left -= pipe.execute()[0]

    def close(self, n: int) -> None:
        assert self.r.xlen(self.key) == 0 and self.r.xlen(self.piped_key) == n
        self.r.unlink(self.key, self.piped_key)


def run_phase(client: redis.Redis, steps: dict[str, Step], chunks: list[Frames]) -> dict[str, tuple[float, float]]:
    """Every step over every chunk, alternating; per step, (wall seconds, server CPU seconds) summed."""

    def server_cpu_s() -> float:
        cpu = client.info("cpu")
        return cpu["used_cpu_user"] + cpu["used_cpu_sys"]

    spent = collections.defaultdict(lambda: [0.0, 0.0])
    for i, chunk in enumerate(chunks):
        for key in list(steps) if i % 2 == 0 else reversed(steps):
            cpu0, t0 = server_cpu_s(), time.perf_counter()
            steps[key](chunk)
            spent[key][0] += time.perf_counter() - t0
            spent[key][1] += server_cpu_s() - cpu0
    return {k: (wall, cpu) for k, (wall, cpu) in spent.items()}


def redis_benchmark(port: int, password: str, n: int, size: int) -> float | None:
    """XADD of a ``size``-byte payload from one client, in requests/s; None if not installed."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    # -a puts the password on the command line: acceptable for this throwaway loopback server.
    cmd = [exe, "-p", str(port), "-a", password, "-c", "1", "-n", str(n), "--csv", "-x"]
    cmd += ["XADD", f"bench-rb:{uuid.uuid4().hex}", "*", "frame"]
    proc = subprocess.run(cmd, input=b"x" * size, capture_output=True, timeout=120)
    rows = [line.split(",") for line in proc.stdout.decode().splitlines() if line.startswith('"XADD')]
    return float(rows[0][1].strip('"')) if proc.returncode == 0 and rows else None


def print_table(args: argparse.Namespace, mb: float, med: dict[str, tuple[float, float]]) -> None:
    def cols(m: tuple[float, float] | None) -> str:
        return f"{m[0]:9.0f} {m[0] * mb:6.0f} {m[1]:10.0f}" if m else f"{'-':>9} {'-':>6} {'-':>10}"

    head = f"{'groups/s':>9} {'MB/s':>6} {'server us':>10}"
    print(f"\n{'':31}{'push (one group)':^27}    {f'pop ({args.batch} groups per read)':^27}".rstrip())
    print(f"{f'median of {args.rounds} rounds':<31}{head}    {head}")
    rows = [
        ("ours (RedisBuffer)", med["ours_push"], med["ours_pop"]),
        ("raw XADD per call", med["raw_push"], med["raw_pop"]),
        (f"raw XADD pipelined x{args.pipeline}", med["raw_piped"], None),
    ]
    for name, push, pop in rows:
        print(f"{name:<31}{cols(push)}    {cols(pop)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=300, help="trajectory groups moved per round and variant")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; medians over them are reported")
    ap.add_argument(
        "--chunk", type=int, default=24, help="groups per turn before switching variant (a multiple of --batch)"
    )
    ap.add_argument("--batch", type=int, default=8, help="groups per read (a learner step's share of groups)")
    ap.add_argument("--pipeline", type=int, default=8, help="XADDs per round trip in the raw pipelined push")
    ap.add_argument("--samples", type=int, default=8, help="samples per group")
    ap.add_argument("--tokens", type=int, default=1024, help="response tokens per sample")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens per group")
    ap.add_argument("--aof-rewrite", action="store_true", help="keep redis' automatic AOF rewrites on")
    ap.add_argument("--no-redis-benchmark", action="store_true", help="skip redis-benchmark even if installed")
    args = ap.parse_args()

    groups = make_groups(args.groups, args.samples, args.tokens, args.prompt_tokens)
    t0 = time.perf_counter()
    frames: Frames = [(g.id, encode_group(g)) for g in groups]
    encode_rate = len(frames) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _, frame in frames:
        decode_group(frame)
    decode_rate = len(frames) / (time.perf_counter() - t0)
    mb = statistics.mean(len(f) for _, f in frames) / 1e6
    chunks = [frames[i : i + args.chunk] for i in range(0, len(frames), args.chunk)]
    print(f"{len(frames)} groups of {mb * 1e3:.1f} KB ({args.samples} x {args.tokens} tokens)")
    print(f"encode {encode_rate:.0f} groups/s ({encode_rate * mb:.0f} MB/s), not timed below")
    print(f"decode {decode_rate:.0f} groups/s ({decode_rate * mb:.0f} MB/s), not timed below")

    res: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)  # (groups/s, server us/group)
    rb_rate = None
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as tmp:
        server = start_redis_server(Path(tmp), appendonly=True)  # as the launcher runs it
        client = redis.Redis.from_url(server.url)
        try:
            if not args.aof_rewrite:
                client.config_set("auto-aof-rewrite-percentage", 0)
            for r in range(args.rounds):
                ours, raw = Ours(server.url, args.batch), Raw(client, args.batch, args.pipeline)
                pushes = {"ours_push": ours.push, "raw_push": raw.push, "raw_piped": raw.push_pipelined}
                spent = run_phase(client, pushes, chunks)
                spent |= run_phase(client, {"ours_pop": ours.pop, "raw_pop": raw.pop}, chunks)
                ours.close(len(frames))
                raw.close(len(frames))
                for key, (wall, cpu) in spent.items():
                    res[key].append((len(frames) / wall, cpu / len(frames) * 1e6))
                print(f"round {r}: " + ", ".join(f"{k} {v[-1][0]:.0f}/s" for k, v in res.items()), flush=True)
            if not args.no_redis_benchmark:
                rb_rate = redis_benchmark(server.port, server.password, len(frames), len(frames[0][1]))
        finally:
            client.close()
            server.stop()

    med = {k: (statistics.median(m[0] for m in v), statistics.median(m[1] for m in v)) for k, v in res.items()}
    print_table(args, mb, med)
    if rb_rate is not None:
        print(f"redis-benchmark (C client, -c 1): XADD of the same size {rb_rate:.0f}/s ({rb_rate * mb:.0f} MB/s)")
    print(f"RESULT push_ratio {med['ours_push'][0] / med['raw_push'][0]:.3f}")
    print(f"RESULT pop_ratio {med['ours_pop'][0] / med['raw_pop'][0]:.3f}")


if __name__ == "__main__":
    main()
