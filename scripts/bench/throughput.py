"""Single-turn training throughput of the working tree against a git revision, measured side by side.

Runs the sort demo (`asyncrl launch --config configs/demo-cpu.yaml`, single-turn: one completion per
episode, scored by its reward) for a fixed number of steps on both trees, alternated (the order flips
every round, so drift on a shared machine hits both alike), and prints each run's trained samples/s
(between the first and the last learner step), the seconds from step 1 to the last, its evals, and the
median ratio:

    .venv/bin/python scripts/bench/throughput.py --base a970dc0 --rounds 3
    .venv/bin/python scripts/bench/throughput.py --base a970dc0 --rounds 3 --set run.eval_every=2
    RESULT single_turn_samples_per_s_over_base <x>   # median over rounds of (working tree / base)

The revision is cloned from this repository into a temporary directory and run from there with
PYTHONPATH pointing at it (the venv is this one). Its role folders are linked under its ``asyncrl/``
(``asyncrl/generators`` -> ``generators/``, ...): the venv's editable install maps
``asyncrl.generators`` to THIS tree's folders, which a plain PYTHONPATH would not override. Both trees
train the same model files (this tree's ``.cache/models``, linked), so only the code differs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from startup import ROOT, launch_cmd

ROLE_FOLDERS = ("generators", "learners", "buffers")  # pyproject.toml's package-dir
MODEL_DIR = Path(".cache/models")


def checkout(rev: str, into: Path) -> Path:
    """``rev`` of this repository, cloned into ``into/base`` and made importable from PYTHONPATH."""
    tree = into / "base"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(tree)], check=True)
    subprocess.run(["git", "-C", str(tree), "checkout", "-q", rev], check=True)
    return prepare(tree)


def prepare(tree: Path) -> Path:
    """``tree`` importable from PYTHONPATH (its role folders linked under ``asyncrl/``), with this tree's models."""
    if tree.resolve() == ROOT:
        return ROOT  # the editable install's own
    for name in ROLE_FOLDERS:
        link = tree / "asyncrl" / name
        if (tree / name).is_dir() and not link.exists():
            link.symlink_to(Path("..") / name)
    (tree / MODEL_DIR).mkdir(parents=True, exist_ok=True)
    for model in (ROOT / MODEL_DIR).iterdir():
        if not (tree / MODEL_DIR / model.name).exists():
            (tree / MODEL_DIR / model.name).symlink_to(model)
    return tree


def run_once(tree: Path, out_dir: Path, name: str, steps: int, extra: list[str]) -> dict:
    """One launch of the demo from ``tree``: its summary, plus ``step_span_s`` (first -> last learner step)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(launch_cmd(out_dir, name, steps, extra), cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run {name} ({tree}) failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    summary = json.loads((out_dir / name / "summary.json").read_text())
    lines = (out_dir / name / "metrics.jsonl").read_text().splitlines()
    ends = sorted({r["time/step_end_at"] for r in map(json.loads, filter(None, lines)) if "time/step_end_at" in r})
    summary["step_span_s"] = ends[-1] - ends[0] if len(ends) > 1 else float("nan")
    return summary


def line(label: str, s: dict) -> str:
    evals = s.get("evals") or {}
    mean = statistics.mean(evals.values()) if evals else float("nan")
    return (
        f"{label:6s} {s['samples_per_s']:7.1f} samples/s, steps 1->{s['final_version']} in {s['step_span_s']:5.1f} s, "
        f"eval {s['initial_eval_reward']:.3f} -> {s['final_eval_reward']:.3f} (mean of {len(evals)} evals {mean:.3f}), "
        f"max staleness {s['max_staleness_seen']}, wall {s['wall_seconds']:.0f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision to compare against (e.g. a970dc0)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="learner steps of each launch (run.steps)")
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--learners", type=int, default=2)
    ap.add_argument("--lag", type=int, default=1, help="run.max_policy_lag")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra --set overrides (repeatable)")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the tree measured against --base (default: this one)")
    args = ap.parse_args()
    extra = [
        *("--generators", str(args.generators), "--learners", str(args.learners)),
        *("--max-policy-lag", str(args.lag)),
        *(x for o in args.extra for x in ("--set", o)),
    ]
    results: dict[str, list[dict]] = {"base": [], "work": []}
    with tempfile.TemporaryDirectory(prefix="asyncrl-throughput-") as tmp:
        trees = {"base": checkout(args.base, Path(tmp)), "work": prepare(args.tree.resolve())}
        out_dir = Path(tmp) / "runs"
        for r in range(args.rounds):
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            print(f"round {r + 1}/{args.rounds} (load average before it: {load}; {os.cpu_count()} cpus)", flush=True)
            for which in ("base", "work") if r % 2 == 0 else ("work", "base"):
                s = run_once(trees[which], out_dir, f"{which}-r{r}", args.steps, extra)
                results[which].append(s)
                print("  " + line(which, s), flush=True)
            base, work = results["base"][-1]["samples_per_s"], results["work"][-1]["samples_per_s"]
            print(f"  ratio {work / base:.3f}", flush=True)
    ratios = [w["samples_per_s"] / b["samples_per_s"] for b, w in zip(results["base"], results["work"], strict=True)]
    for which in ("base", "work"):
        runs = results[which]
        print(
            f"RESULT {which}_samples_per_s {statistics.median(s['samples_per_s'] for s in runs):.1f}"
            f"  final_eval_reward {statistics.median(s['final_eval_reward'] for s in runs):.3f}"
            f"  steps_span_s {statistics.median(s['step_span_s'] for s in runs):.2f}"
        )
    print(f"RESULT single_turn_samples_per_s_over_base {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
