"""The launcher's run statistics: failed episodes folded by cause, and a summary that is valid JSON
whatever a metric held."""

from __future__ import annotations

import json

from asyncrl.config import RunConfig
from asyncrl.observe import lengths
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
    means = ("generated_tokens_per_sample", "trained_tokens_per_sample", "dropped_stale_tokens_per_sample")
    assert {k: bias["length_bias"][k] for k in (*means, "trained_over_generated")} == {
        "generated_tokens_per_sample": 10.0,
        "trained_tokens_per_sample": 8.0,
        "dropped_stale_tokens_per_sample": 16.0,
        "trained_over_generated": 0.8,
    }
    # records without histograms (an older tree's): no distribution figures
    assert bias["length_bias"]["ks_trained_vs_generated"] is None and bias["length_bias"]["trained_samples"] == 0


def test_the_summary_and_status_hold_the_length_distributions_and_their_ks_statistic(tmp_path):
    """Generated: 10 samples of 8 tokens, 10 of 32; trained: the short ones; dropped as stale: the long ones.
    Every short sample trained and no long one: KS 0.5 (half the generated mass lies past every trained one)."""
    short, long = lengths.bin_of(8), lengths.bin_of(32)
    stats = RunStats(RunConfig(), tmp_path)
    stats._fold({"episodes/done": 20, "episodes/model_tokens": 400,
                 "episodes/model_tokens_hist": {str(short): 10, str(long): 10}}, None)  # fmt: skip
    stats._fold({"buffer/staleness_max": 1, "buffer/staleness_mean": 0.5, "buffer/dropped_stale": 1,
                 "learner/samples": 10, "learner/wall_seconds": 1.0, "learner/tokens": 80, "learner/version": 1,
                 "buffer/dropped_stale_samples": 10, "buffer/dropped_stale_tokens": 320,
                 "learner/tokens_hist": {str(short): 10}, "buffer/dropped_stale_tokens_hist": {str(long): 10}},
                None)  # fmt: skip
    bias = stats.summary("completed")["length_bias"]
    assert bias["ks_trained_vs_generated"] == 0.5 and bias["trained_over_generated"] == 0.4
    assert (bias["generated_p50"], bias["generated_p90"], bias["trained_p90"], bias["dropped_stale_p50"]) == (
        8, 32, 8, 32)  # fmt: skip
    assert bias["histograms"] == {"generated": {"8": 10, "32": 10}, "trained": {"8": 10}, "dropped_stale": {"32": 10}}
    from rich.console import Console

    from asyncrl.observe.status import _render_lengths

    console = Console(record=True, width=400)
    _render_lengths(json.loads(json.dumps(bias)), console)
    line = console.export_text()
    assert "trained/generated 0.4, KS 0.5" in line and "dropped stale 32.0 (median 32, p90 32; 10 samples)" in line
