"""The launcher's run statistics: failed episodes folded by cause, and a summary that is valid JSON
whatever a metric held."""

from __future__ import annotations

import json

from asyncrl.config import RunConfig
from asyncrl.run.stats import Progress, RunStats, eta_seconds, format_eta


def test_failures_fold_by_cause_and_the_summary_stays_valid_json(tmp_path):
    stats = RunStats(RunConfig(), tmp_path)
    for record in (
        {"episodes/done": 8, "episodes/failed": 3, "episodes/failed_reward_error": 2, "episodes/failed_env_timeout": 1},
        {"episodes/done": 8, "episodes/failed": 1, "episodes/failed_reward_error": 1},
    ):
        stats._fold(record, None)
    stats.reward = float("nan")  # whatever a metric held
    stats.evals[0] = float("inf")
    summary = json.loads((stats.write_summary(tmp_path, "completed"), tmp_path / "summary.json")[1].read_text())
    assert summary["episodes"] == 16 and summary["episodes_failed"] == {"env_timeout": 1, "reward_error": 3}
    assert summary["evals"] == {"0": None} and summary["initial_eval_reward"] is None


def test_the_progress_line_shows_an_eta_from_the_recent_step_rate(tmp_path):
    stats, progress = RunStats(RunConfig(steps=20), tmp_path), Progress(None, steps=20)
    step = {"buffer/staleness_max": 0, "buffer/staleness_mean": 0.0, "buffer/dropped_stale": 0, "learner/samples": 8}
    assert "ETA -" in progress.info(stats, now=100.0)  # no step yet
    stats._fold({**step, "learner/version": 1, "learner/wall_seconds": 1.0, "time": 100.0}, None)
    assert "ETA -" in progress.info(stats, now=101.0)  # one step: no rate yet
    stats._fold({**step, "learner/version": 2, "learner/wall_seconds": 5.0, "time": 104.0}, None)
    assert "ETA 1m12s" in progress.info(stats, now=104.0)  # 18 steps to go at 4 s a step
    assert "ETA 1m02s" in progress.info(stats, now=114.0)  # counting down between steps
    stats._fold({**step, "learner/version": 1, "learner/wall_seconds": 1.0, "time": 200.0}, None)
    assert "ETA -" in progress.info(stats, now=200.0)  # learners restarted from a checkpoint: a new pace
    assert eta_seconds([(0.0, 10), (30.0, 20)], 20, now=35.0) == 0.0  # done: never below zero
    assert [format_eta(s) for s in (None, 0.4, 59.6, 61, 3600 * 2 + 7 * 60 + 1)] == [
        "ETA -", "ETA 0s", "ETA 1m00s", "ETA 1m01s", "ETA 2h07m",
    ]  # fmt: skip


def test_the_summary_compares_the_lengths_trained_with_those_generated_and_dropped(tmp_path):
    """Generators made 16 samples of 10 model tokens on average; the learners trained the 12 of 8 and dropped
    the 4 of 16 as stale: trained / generated 0.8, the long ones lost. A tree without the figures: None."""
    stats = RunStats(RunConfig(), tmp_path)
    assert stats.length_bias["trained_over_generated"] is None
    stats._fold({"episodes/done": 16, "episodes/model_tokens": 160}, None)
    step = {"buffer/staleness_max": 1, "buffer/staleness_mean": 0.5, "buffer/dropped_stale": 1, "learner/samples": 6,
            "learner/wall_seconds": 1.0, "learner/tokens": 48, "buffer/dropped_stale_samples": 2,
            "buffer/dropped_stale_tokens": 32}  # fmt: skip
    for version in (1, 2):
        stats._fold({**step, "learner/version": version}, None)
    stats._fold({**step, "learner/version": 3, "buffer/dropped_stale_tokens": None}, None)  # an older learner's
    bias = json.loads((stats.write_summary(tmp_path, "completed"), tmp_path / "summary.json")[1].read_text())
    assert bias["length_bias"] == {
        "generated_tokens_per_sample": 10.0,
        "trained_tokens_per_sample": 8.0,
        "dropped_stale_tokens_per_sample": 16.0,
        "trained_over_generated": 0.8,
    }
