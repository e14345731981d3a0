"""Off-policy stress: the demo with --max-policy-lag 8, without and with off-policy corrections.

Groups reach the learner up to 8 versions stale: two generators run ahead of one learner, and each
group is replayed (``buffer.replay_times``) while it stays within the lag bound. Three learners:

* ``none``           plain policy gradient, w = 1: the stale samples are treated as on-policy;
* ``tis``            policy gradient with token truncated IS, w = min(pi / mu, C);
* ``decoupled_ppo``  PPO clip against the proximal policy, w = min(pi_prox / mu, C) (the grpo preset).

All use GRPO advantages, token-mean and no KL. With one optimizer step per batch (``--minibatches 1``,
the default), decoupled PPO's proximal policy is the current one, so ``tis`` and ``decoupled_ppo``
compute the same loss: their difference measures run-to-run noise (staleness depends on timing). With
``--minibatches 4`` each batch takes 4 optimizer steps against the pi_prox of its start, and the clip
binds (``policy_clip_frac``). Variants alternate over ROUNDS (machine noise hits all); medians are
reported. A measurement, not a pass bar:

    .venv/bin/python scripts/bench/offpolicy.py --rounds 2 [--minibatches 4]
    RESULT <correction> final_eval_reward <x> behaviour_kl_mean <x> staleness_mean <x>
        policy_clip_frac <x> correction_clip_frac <x> wall_s <x>
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

VARIANTS = {
    "none": ["algorithm.policy_loss=policy_gradient", "algorithm.correction=none"],
    "tis": ["algorithm.policy_loss=policy_gradient", "algorithm.correction=tis"],
    "decoupled_ppo": ["algorithm.policy_loss=ppo_clip", "algorithm.correction=decoupled_ppo"],
}


def run_once(out_dir: Path, name: str, sets: list[str], args) -> tuple[dict, list[dict]]:
    common = [
        "algorithm.name=grpo",
        "algorithm.kl_coef=0",
        "algorithm.aggregation=token-mean",
        f"buffer.replay_times={args.replay}",
        f"learner.minibatches={args.minibatches}",
        f"generator.engine.type={args.engine}",
        "run.eval_every=0",
        f"run.out_dir={out_dir}",
    ]
    cmd = [sys.executable, "-m", "asyncrl.cli", "launch", "--config", "configs/demo-cpu.yaml", "--name", name,
           "--max-policy-lag", str(args.lag), "--generators", str(args.generators), "--learners", "1",
           "--steps", str(args.steps)]  # fmt: skip
    cmd += [x for s in [*common, *sets, *args.extra] for x in ("--set", s)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run {name} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    lines = (out_dir / name / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "learner/version" in r]
    return json.loads((out_dir / name / "summary.json").read_text()), records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lag", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--replay", type=int, default=4, help="buffer.replay_times: reuse groups while fresh enough")
    ap.add_argument("--minibatches", type=int, default=1, help="learner.minibatches: optimizer steps per batch")
    ap.add_argument("--engine", default="hf", help="generator engine (hf starts fast; vllm adds kernel mismatch)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra --set overrides")
    args = ap.parse_args()
    results: dict[str, list[tuple[float, ...]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, sets in VARIANTS.items():
                summary, records = run_once(Path(tmp), f"{name}-r{r}", sets, args)
                kl = statistics.fmean(x["learner/behaviour_kl"] for x in records)
                stale = statistics.fmean(x["buffer/staleness_mean"] for x in records)
                clip = statistics.fmean(x["learner/policy_clip_frac"] for x in records)
                corr = statistics.fmean(next(v for k, v in x.items() if k.endswith("_clip_frac") and
                                             "policy" not in k and "value" not in k) for x in records)  # fmt: skip
                results[name].append((summary["final_eval_reward"], kl, stale, clip, corr, summary["wall_seconds"]))
                print(
                    f"round {r} {name}: eval reward {summary['initial_eval_reward']:.3f} -> "
                    f"{summary['final_eval_reward']:.3f}, behaviour KL mean {kl:.4f}, staleness mean {stale:.2f} "
                    f"(max {summary['max_staleness_seen']}), policy clip {clip:.4f}, correction clip {corr:.4f}, "
                    f"wall {summary['wall_seconds']:.0f}s",
                    flush=True,
                )
    for name, runs in results.items():
        reward, kl, stale, clip, corr, wall = (statistics.median(col) for col in zip(*runs, strict=True))
        print(
            f"RESULT {name} final_eval_reward {reward:.3f} behaviour_kl_mean {kl:.4f} staleness_mean {stale:.2f} "
            f"policy_clip_frac {clip:.4f} correction_clip_frac {corr:.4f} wall_s {wall:.0f}"
        )


if __name__ == "__main__":
    main()
