"""Blocking faults in user code, through whole demo runs: what each becomes, and that the run goes on.

Each scenario is an ``asyncrl launch`` of a demo with misbehaving plain code from ``faulty.py``:

* ``hang-reward``: the sort demo, its reward hanging 60 s on 5% of prompts, ``episode.reward_timeout_s=3``;
* ``calc``: demo-calc, its calculator (plain) hanging on 10% and raising on 10% of calls;
* ``abort``: demo-guess, its environment (plain) calling ``os.abort()`` on 5% of steps, with the
  default 4 worker processes (the other sessions of a crashed worker are replayed elsewhere).

For each it prints the versions reached of those asked, failures by cause, the buffer's ``lost``, the
generator restarts and the peak thread and child-process counts of any generator process:

    .venv/bin/python scripts/bench/faults.py hang-reward calc abort
    RESULT hang-reward_versions 40/40  ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent

SCENARIOS = {
    "hang-reward": (
        "configs/demo-cpu.yaml",
        ["data.reward=faulty:hanging_sort_reward", "episode.reward_timeout_s=3"],
    ),
    "calc": ("configs/demo-calc.yaml", ["episode.tools=[faulty:flaky_calc]", "episode.tool_timeout_s=3"]),
    "abort": ("configs/demo-guess.yaml", ["episode.function=faulty:AbortingGuessEnv", "episode.options={share: 0.05}"]),
}


def run(name: str, out: Path, extra: list[str]) -> dict:
    config, overrides = SCENARIOS[name]
    sets = [x for o in [*overrides, *extra] for x in ("--set", o)]
    cmd = [sys.executable, "-m", "asyncrl.cli", "launch", "--config", config, "--name", name,
           "--set", f"run.out_dir={out}", *sets]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    summary = json.loads((out / name / "summary.json").read_text())
    summary["exit_code"], summary["seconds"] = proc.returncode, time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", help=f"of {', '.join(SCENARIOS)} (default: all)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra --set overrides for every run")
    args = ap.parse_args()
    if unknown := set(args.scenarios) - set(SCENARIOS):
        ap.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.scenarios or list(SCENARIOS):
            s = run(name, Path(tmp), args.extra)
            failed = sum(s["episodes_failed"].values())
            print(
                f"{name}: exit {s['exit_code']} ({s['exit_reason']}), version {s['final_version']}/{s['steps']} "
                f"in {s['seconds']:.0f} s; {s['episodes']} episodes, {failed} failed: {s['episodes_failed']}; "
                f"tool calls failed: {s['tool_calls_failed']}; "
                f"lost {s['buffer']['lost'] if s['buffer'] else '?'}; restarts {s['restarts']}; "
                f"peaks {s['generator_peaks']}",
                flush=True,
            )
            print(f"RESULT {name}_versions {s['final_version']}/{s['steps']}")
            print(f"RESULT {name}_failed_share {failed / max(s['episodes'], 1):.3f}")
            print(f"RESULT {name}_lost {s['buffer']['lost'] if s['buffer'] else 'unknown'}")
            print(f"RESULT {name}_generator_restarts {s['restarts'].get('generators', 0)}")
            print(f"RESULT {name}_peak_threads {s['generator_peaks']['threads']}")
            print(f"RESULT {name}_peak_child_processes {s['generator_peaks']['child_processes']}")


if __name__ == "__main__":
    main()
