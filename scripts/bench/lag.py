"""Synchronous vs bounded-async throughput of the demo, measured side by side.

Runs `asyncrl launch` on the demo config alternately with --max-policy-lag 0 and K (default 2),
ROUNDS times each (alternating, so machine noise hits both), and prints trained samples/s
(between the first and the last learner step), the final eval reward and the ratio:

    .venv/bin/python scripts/bench/lag.py --rounds 2
    RESULT sync_samples_per_s <x>
    RESULT async_samples_per_s <x>
    RESULT async_over_sync <x>
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_once(out_dir: Path, name: str, lag: int, extra: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "launch",
        "--config",
        "configs/demo-cpu.yaml",
        "--name",
        name,
        "--max-policy-lag",
        str(lag),
        "--set",
        f"run.out_dir={out_dir}",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run {name} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads((out_dir / name / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lag", type=int, default=2)
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra --set overrides")
    args = ap.parse_args()
    extra = [x for o in args.extra for x in ("--set", o)]
    results: dict[int, list[dict]] = {0: [], args.lag: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for lag in (0, args.lag):
                s = run_once(Path(tmp), f"lag{lag}-r{r}", lag, extra)
                results[lag].append(s)
                print(
                    f"round {r} lag {lag}: {s['samples_per_s']:.1f} samples/s, eval reward "
                    f"{s['initial_eval_reward']:.3f} -> {s['final_eval_reward']:.3f}, "
                    f"max staleness {s['max_staleness_seen']}, wall {s['wall_seconds']:.0f}s",
                    flush=True,
                )
    sync = statistics.median(s["samples_per_s"] for s in results[0])
    asyn = statistics.median(s["samples_per_s"] for s in results[args.lag])
    print(f"RESULT sync_samples_per_s {sync:.1f}")
    print(f"RESULT async_samples_per_s {asyn:.1f}")
    print(f"RESULT async_over_sync {asyn / sync:.3f}")


if __name__ == "__main__":
    main()
