"""The generator's own CPU per single-turn group, the engine left out: an engine that answers every request
at once (each sample 4 tokens), the real episode path, the real worker pool for the reward, a real Redis
buffer. What the generator spends per group besides sampling (episodes, rewards, frames, pushes), measured
side by side with ``--set`` overrides (alternated rounds; each a fresh generator on the same redis-server):

    .venv/bin/python scripts/bench/episode_overhead.py --set episode.batch_rewards=false
    RESULT generator_cpu_ms_per_group <ms> (overrides: <ms>)
    RESULT pool_cpu_ms_per_group <ms> (overrides: <ms>)
    RESULT cpu_per_group_over_overrides <x>   # (generator + pool) / the same with the overrides, median

The model is the demo's tiny Llama, untrained (its tokenizer decodes; no weights are used).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # generator_common: the tests' Generator set-up

from generator_common import make_generator, save_tiny_model  # noqa: E402

from asyncrl import buffers  # noqa: E402
from asyncrl.config import load_config, parse_override  # noqa: E402
from asyncrl.control import RunControl, connect  # noqa: E402
from asyncrl.fleet.redis_server import start_redis_server  # noqa: E402
from asyncrl.generators.engine import Engine, StepOutput  # noqa: E402
from asyncrl.keys import run_prefix  # noqa: E402
from asyncrl.weights import MemoryWeightBus  # noqa: E402

GROUPS_PER_STEP = 8


class InstantEngine(Engine):
    """Every request's samples end at its first step, each with 4 tokens."""

    multi_sample = True
    max_model_len = 64

    def __init__(self):
        self.live: dict[str, int] = {}

    def add_request(self, request_id, prompt, sampling, images=()):
        self.live[request_id] = sampling.n

    def step(self):
        outs = [
            StepOutput(r, [98, 99, 100, 258], [-0.1] * 4, True, "stop", i)
            for r, n in self.live.items()
            for i in range(n)
        ]
        self.live = {}
        return outs

    def abort_requests(self, request_ids):
        for r in request_ids:
            self.live.pop(r, None)

    def load_weights(self, tensors):
        pass


def children_cpu_s() -> float:
    """CPU seconds of this process's live children (the pool's workers)."""
    total = 0.0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if pid.isdigit() and int(fields[1]) == os.getpid():
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def measure(model: Path, url: str, overrides: dict, groups: int) -> tuple[float, float]:
    """(generator, pool) CPU ms per group over ``groups`` groups, after a warm-up step."""
    settings = {"model.path": str(model), "model.recipe": None, "run.max_policy_lag": 10**6, "data.eval": None}
    cfg = load_config(str(ROOT / "configs/demo-cpu.yaml"), {**settings, **overrides})
    prefix = run_prefix(f"bench-{uuid.uuid4().hex[:8]}")
    buffer = buffers.setup(cfg.buffer, url, prefix)
    sub = MemoryWeightBus().subscriber("generator-0", have=0)
    gen = make_generator(cfg, InstantEngine(), RunControl(connect(url), prefix), sub, model, buffer)

    async def steps(n: int) -> None:
        for _ in range(n):
            seqs = [buffer.try_start_group(0, 10**6, GROUPS_PER_STEP) for _ in range(GROUPS_PER_STEP)]
            await asyncio.gather(*(gen.run_group(s) for s in seqs))

    async def run() -> tuple[float, float]:
        pump = asyncio.create_task(gen.pump.run())
        try:
            await steps(2)  # warm-up: the pool's workers up
            cpu, pool = time.process_time(), children_cpu_s()
            await steps(groups // GROUPS_PER_STEP)
            return 1000 * (time.process_time() - cpu) / groups, 1000 * (children_cpu_s() - pool) / groups
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
            if gen.pool is not None:
                await gen.pool.aclose()

    try:
        return asyncio.run(run())
    finally:
        buffer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="dotted override (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--groups", type=int, default=400, help="groups per measurement")
    args = ap.parse_args()
    overrides = dict(parse_override(o) for o in args.overrides)
    results: dict[str, list[tuple[float, float]]] = {"working tree": [], "overrides": []}
    with tempfile.TemporaryDirectory(prefix="asyncrl-episode-overhead-") as tmp:
        model = save_tiny_model(Path(tmp) / "model")
        server = start_redis_server(Path(tmp) / "redis")
        try:
            for r in range(args.rounds):
                for which in ("working tree", "overrides") if r % 2 == 0 else ("overrides", "working tree"):
                    gen, pool = measure(model, server.url, overrides if which == "overrides" else {}, args.groups)
                    results[which].append((gen, pool))
                    print(f"round {r + 1} {which:12s}: generator {gen:.3f} ms CPU/group, pool {pool:.3f}", flush=True)
        finally:
            server.stop()
    (g, p), (go, po) = ([statistics.median(x) for x in zip(*results[k], strict=True)] for k in results)
    print(f"RESULT generator_cpu_ms_per_group {g:.3f} (overrides: {go:.3f})")
    print(f"RESULT pool_cpu_ms_per_group {p:.3f} (overrides: {po:.3f})")
    ratios = [(a + b) / (c + d) for (a, b), (c, d) in zip(results["working tree"], results["overrides"], strict=True)]
    print(f"RESULT cpu_per_group_over_overrides {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
