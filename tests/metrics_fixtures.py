"""Metric records shaped like a real demo run's ``metrics.jsonl`` (field names as the generators,
learners and launcher write them), for tests of what reads them: sinks, ``asyncrl plot``, ``RunStats``
(through :class:`Stream`, a stand-in for the run's metrics stream)."""

from __future__ import annotations

import json
from pathlib import Path

T0 = 1_800_000_000.0  # a wall clock: a float32 would round it to minutes, the event's double keeps it


def demo_records(steps: int = 8, failed: bool = True, launcher: bool = True) -> list[dict]:
    """Two generators, a learner, evals at 0 and ``steps``, a checkpoint, a launcher record of no
    version and (``failed``) failed episodes of two causes; with ``launcher``, also the records the
    launcher adds to metrics.jsonl itself: weight syncs and buffer depth."""
    out: list[dict] = [{"fleet/generators": 2, "time": T0}]
    for v in range(steps + 1):
        t = T0 + 10 + 3 * v
        for g in (0, 1):
            rec = {"time": t + 0.1 * g, "source": f"generator/{g}", "generator/version": v, "episodes/done": 16}
            rec |= {"generator/tokens_per_s": 100.0 + v, "episodes/failed": 0, "weights/applied_at": t + 0.5}
            rec |= {"weights/probe_logprob_diff": 0.4 + 0.01 * g, "weights/probe_logprob_diff_mean": 0.03 + 0.001 * v}
            if failed and v in (2, 5):
                rec |= {"episodes/failed": 3, "episodes/failed_reward_error": 2, "episodes/failed_env_timeout": 1}
            out.append(rec)
        if v in (0, steps):
            out.append({"time": t + 1, "source": "generator/0", "eval/version": v, "eval/reward_mean": 0.2 + 0.08 * v})
        if v == 0:
            continue
        out.append(
            {
                "time": t + 2,
                "source": "learner/0",
                "learner/version": v,
                "learner/loss": -0.01 * v,
                "learner/reward_mean": 0.3 + 0.05 * v,
                "learner/samples": 64.0,
                "learner/wall_seconds": 3.0 * v,
                "buffer/staleness_mean": 0.5,
                "buffer/staleness_max": v % 2,
                "buffer/dropped_stale": 0.0,
                "time/collect_s": 2.5,
                "time/train_s": 0.4,
                "time/step_end_at": t + 1.9,
                "learner/tis_clipped": True,  # not a number: no scalar
                "learner/note": "text",
            }
        )
        if launcher:
            out.append({"time": t + 2.1, "weights/version": v, "weights/sync_seconds": 0.1 * v})
            out.append({"time": t + 2.2, "buffer/queued": 8 - v % 3, "buffer/pending": 1})
        if v == steps // 2:
            out.append({"time": t + 2.3, "source": "learner/0", "checkpoint/version": v, "checkpoint/seconds": 0.04})
    return out


def write_run(run_dir: Path, records: list[dict], summary: dict | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


class Stream:
    """The part of RunControl that RunStats.drain reads: one batch of records per drain."""

    bad_metrics = 0

    def __init__(self, *batches: list[dict]):
        self.batches = list(batches)

    def read_metrics(self, cursor: str) -> tuple[str, list[dict]]:
        return cursor, self.batches.pop(0) if self.batches else []

    def trim_metrics(self, cursor: str) -> None:
        pass

    def staleness_histogram(self) -> dict[int, int]:
        return {}
