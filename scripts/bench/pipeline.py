"""The demo pipeline, stage by stage, each one command on its config (docs/offline.md):

    asyncrl sft    --config configs/sort-sft.yaml      # correct sorting, from the demo model's buggy warm-up
    asyncrl rm     --config configs/sort-rm.yaml       # a reward model on (sorted, wrong) pairs
    asyncrl launch --config configs/sort-grpo-rm.yaml  # GRPO against that reward model
    asyncrl dpo    --config configs/sort-dpo.yaml      # DPO on the same pairs, the offline alternative

Every stage starts from the demo model; the true sort reward (``asyncrl.demo.sort:reward``, greedy, held
out) is measured before and after. Prints a markdown table and one RESULT line per figure:

    .venv/bin/python scripts/bench/pipeline.py [--out runs/pipeline]
    RESULT sft_eval_loss_drop <float>      RESULT sft_reward_gain <float>
    RESULT rm_pair_accuracy <float>        RESULT grpo_rm_reward_gain <float>
    RESULT dpo_reward_gain <float>
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], out: Path) -> float:
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "asyncrl.cli", *args, "--set", f"run.out_dir={out}", "--set", "run.overwrite=true"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args[:3])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def evals(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "eval/version" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/pipeline", help="parent folder of the four run directories")
    out = (ROOT / ap.parse_args().out).resolve()
    rows, results = [], {}

    seconds = run(["sft", "--config", "configs/sort-sft.yaml"], out)
    first, last = evals(out / "sort-sft")[0], evals(out / "sort-sft")[-1]
    results["sft_eval_loss_drop"] = first["eval/loss"] - last["eval/loss"]
    results["sft_reward_gain"] = last["eval/reward"] - first["eval/reward"]
    rows.append(("sft", f"held-out loss {first['eval/loss']:.3f} -> {last['eval/loss']:.3f}, "
                 f"greedy reward {first['eval/reward']:.3f} -> {last['eval/reward']:.3f}", seconds))  # fmt: skip

    seconds = run(["rm", "--config", "configs/sort-rm.yaml"], out)
    last = evals(out / "sort-rm")[-1]
    results["rm_pair_accuracy"] = last["eval/accuracy"]
    rows.append(("rm", f"held-out pair accuracy {last['eval/accuracy']:.3f}", seconds))

    reward = f"rm:{out / 'sort-rm' / 'export'}"
    seconds = run(["launch", "--config", "configs/sort-grpo-rm.yaml", "--set", f"data.reward={reward}"], out)
    summary = json.loads((out / "sort-grpo-rm" / "summary.json").read_text())
    before, after = summary["initial_eval_reward"], summary["final_eval_reward"]
    results["grpo_rm_reward_gain"] = after - before
    rows.append(("grpo vs rm", f"true greedy reward {before:.3f} -> {after:.3f}", seconds))

    seconds = run(["dpo", "--config", "configs/sort-dpo.yaml"], out)
    first, last = evals(out / "sort-dpo")[0], evals(out / "sort-dpo")[-1]
    results["dpo_reward_gain"] = last["eval/reward"] - first["eval/reward"]
    rows.append(("dpo", f"greedy reward {first['eval/reward']:.3f} -> {last['eval/reward']:.3f}, "
                 f"pair accuracy {last['eval/accuracy']:.3f}", seconds))  # fmt: skip

    print("| stage | result | seconds |\n|---|---|---|")
    for stage, result, secs in rows:
        print(f"| {stage} | {result} | {secs:.0f} |")
    for name, value in results.items():
        print(f"RESULT {name} {value:.3f}")


if __name__ == "__main__":
    main()
