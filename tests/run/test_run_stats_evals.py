"""The evaluations a run reports (issue 25): an interrupted run shows its last evaluation and the version
it scored, not ``-``; an evaluation of a later version than its eval point says so."""

from __future__ import annotations

import json

from metrics_fixtures import Stream

from asyncrl.config import RunConfig
from asyncrl.run.stats import RunStats, summary_line


def evaluation(version: int, reward: float, point: int | None = None) -> dict:
    record = {"time": 1.0, "source": "generator/0", "eval/version": version, "eval/reward_mean": reward}
    record |= {"eval/exact_rate": 0.0, "eval/failed": 0}
    return record if point is None else {**record, "eval/point": point}


def test_an_interrupted_run_reports_its_last_eval_and_its_version(tmp_path):
    stats = RunStats(RunConfig(steps=40), tmp_path)
    stats.drain(Stream([evaluation(0, 0.227), evaluation(20, 0.383)]))
    summary = stats.write_summary(tmp_path, "interrupted")
    assert summary["final_eval_reward"] is None  # no eval of the final version: the run did not get there
    assert (summary["last_eval_version"], summary["last_eval_reward"]) == (20, 0.383)
    assert json.loads((tmp_path / "summary.json").read_text())["last_eval_version"] == 20
    line = summary_line("demo", summary, tmp_path)
    assert "eval reward 0.227 -> 0.383 at version 20 of 40" in line, line
    assert " -> -" not in line


def test_a_completed_run_reports_its_final_eval_plainly(tmp_path):
    stats = RunStats(RunConfig(steps=40), tmp_path)
    stats.drain(Stream([evaluation(0, 0.227), evaluation(20, 0.383), evaluation(40, 0.9)]))
    summary = stats.write_summary(tmp_path, "completed")
    assert summary["final_eval_reward"] == 0.9 and summary["last_eval_version"] == 40
    assert "eval reward 0.227 -> 0.900," in summary_line("demo", summary, tmp_path)


def test_a_run_without_evals_shows_dashes(tmp_path):
    summary = RunStats(RunConfig(steps=40), tmp_path).write_summary(tmp_path, "interrupted")
    assert summary["last_eval_version"] is None and summary["last_eval_reward"] is None
    assert "eval reward - -> -," in summary_line("demo", summary, tmp_path)


def test_an_eval_of_a_later_version_than_its_point_says_so(tmp_path):
    """Versions passed faster than the generator applied them: point 10 was evaluated at version 12."""
    stats, said = RunStats(RunConfig(steps=40), tmp_path), []
    two = {**evaluation(21, 0.6, point=20), "eval/points": [15, 20]}  # both passed before 21 was served
    stats.drain(Stream([evaluation(0, 0.2, point=0), evaluation(12, 0.5, point=10), two]), say=said.append)
    assert said[0].startswith("eval at version 0: reward 0.200")
    assert said[1].startswith("eval at version 12 (eval point 10: the first version served at or after it): "), said
    assert said[2].startswith("eval at version 21 (eval point 15, 20: the first version served at or after it)")
    assert stats.evals == {0: 0.2, 12: 0.5, 21: 0.6} and stats.eval_points == {0, 10, 15, 20}
