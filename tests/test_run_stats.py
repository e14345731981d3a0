"""The launcher's run statistics: failed episodes folded by cause, and a summary that is valid JSON
whatever a metric held."""

from __future__ import annotations

import json

from asyncrl.config import RunConfig
from asyncrl.run_stats import RunStats


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
