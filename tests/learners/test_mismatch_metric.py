"""What ``learner/behaviour_logprob_mismatch`` covers, and the sync-health figure beside it.

The mismatch compares the learner's log-probs with the behaviour log-probs only on tokens its own version
sampled (the only ones where both are the same weights); at a lag of 1 or more there are few or none,
so the step record also carries the weight-sync probe's figure, ``weights/probe_logprob_diff_max``,
which every version has. Checked on CPU against a slow reference written token by token.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncrl.config.presets import get_preset
from asyncrl.learners.batching import make_batch
from asyncrl.learners.objective import StepLoss
from asyncrl.learners.records import dense, step_record
from asyncrl.learners.train_step import behaviour_mismatch
from asyncrl.protocol import Sample, TrajectoryGroup

LEARNER_VERSION = 5


def group(*samples: tuple[list[int], list[float]]) -> TrajectoryGroup:
    """A group of samples given as (versions per token, behaviour log-probs per token)."""
    out = []
    for versions, mu in samples:
        n = len(versions)
        out.append(Sample(np.arange(n, dtype=np.int32), np.array(mu, np.float32), np.array(versions, np.int32), 1.0))
    return TrajectoryGroup(np.array([1, 2], np.int32), out, 0, 0, "gen-0")


def reference(groups: list[TrajectoryGroup], pi: list[list[float]], version: int) -> tuple[float, int]:
    """Sum and count of |pi_t - mu_t| over tokens whose recorded version is ``version``, one by one."""
    total, count = 0.0, 0
    for sample, pi_row in zip([s for g in groups for s in g.samples], pi, strict=True):
        for t in range(len(sample.tokens)):
            if sample.versions[t] == version:
                total += abs(pi_row[t] - float(sample.logprobs[t]))
                count += 1
    return total, count


def learner_logprobs(batch: dict, pi: list[list[float]], prompt_len: int) -> torch.Tensor:
    """log pi laid out as the batch lays out the response (token t at column P - 1 + t), 0 elsewhere."""
    out = torch.zeros_like(batch["behaviour_logprobs"])
    for i, row in enumerate(pi):
        out[i, prompt_len - 1 : prompt_len - 1 + len(row)] = torch.tensor(row)
    return out


def test_only_tokens_of_the_learners_own_version_count():
    groups = [
        group(([4, 4, 5, 5], [-1.0, -2.0, -0.5, -0.25]), ([5, 5, 5], [-0.1, -0.2, -0.3])),
        group(([3, 4, 5], [-3.0, -1.0, -2.0])),  # a partial rollout across three versions
    ]
    pi = [[-1.5, -1.0, -0.75, -0.25], [-0.1, -0.4, -0.35], [-0.5, -0.5, -1.0]]
    batch = make_batch(groups, 8, get_preset("grpo"), pad_id=0, version=LEARNER_VERSION)
    got_sum, got_count = behaviour_mismatch(learner_logprobs(batch, pi, prompt_len=2), batch)
    want_sum, want_count = reference(groups, pi, LEARNER_VERSION)
    assert got_count == want_count == 6
    assert abs(got_sum - want_sum) < 1e-6


def test_a_batch_of_stale_tokens_has_no_mismatch_figure_but_a_sync_figure():
    groups = [group(([4, 4, 4], [-1.0, -1.0, -1.0]))]  # lag 1: every token one version old
    batch = make_batch(groups, 8, get_preset("grpo"), pad_id=0, version=LEARNER_VERSION)
    mismatch = behaviour_mismatch(learner_logprobs(batch, [[-2.0, -2.0, -2.0]], prompt_len=2), batch)
    assert mismatch == (0.0, 0.0)  # nothing the learner's own weights sampled: nothing to compare
    total = {
        "stale_sum": 1, "groups": 1, "dropped_stale": 0, "dead": 0, "foreign": 0, "filtered": 0, "replays": 0,
        "mismatch_sum": mismatch[0], "mismatch_tokens": mismatch[1], "reward_sum": 1.0, "samples": 1, "tokens": 3,
        "turns": 1, "stale_samples": 0, "stale_tokens": 0, **dense("trained_bin", [3]), **dense("stale_bin", []),
    }  # fmt: skip
    out = StepLoss(torch.tensor(0.0), None, {"learner/loss": 0.0})
    sync = {"probe_logprob_diff_max": 2.5e-6, "versions": {"4": 2.5e-6, "5": 1e-6}}
    record = step_record(LEARNER_VERSION + 1, out, total, 1, 1e-5, sync)
    assert record["learner/behaviour_logprob_mismatch"] is None
    assert record["learner/behaviour_logprob_mismatch_tokens"] == 0
    assert record["weights/probe_logprob_diff_max"] == 2.5e-6
    none_yet = step_record(1, out, total, 1, 1e-5, {"probe_logprob_diff_max": None, "versions": {}})
    assert none_yet["weights/probe_logprob_diff_max"] is None
