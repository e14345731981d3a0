"""A learner step's metrics: this rank's sums (all-reduced over the ranks) and the ``metrics.jsonl`` record
made of them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.observe import lengths

if TYPE_CHECKING:
    from asyncrl.buffers.consumer import Batch
    from asyncrl.learners.objective import StepLoss
    from asyncrl.protocol import TrajectoryGroup


def step_sums(groups: list[TrajectoryGroup], batch: Batch, stale: list[int], mismatch: tuple[float, float]) -> dict:
    """This rank's share of a step's metrics, as sums to all-reduce over the ranks."""
    samples = [s for g in groups for s in g.samples]
    return {
        "stale_sum": sum(stale),
        "groups": len(stale),
        "dropped_stale": batch.counts["stale"],
        "dead": batch.counts["dead"],
        "foreign": batch.counts["foreign"],
        "filtered": batch.counts["filtered"],
        "replays": batch.replays,
        "mismatch_sum": mismatch[0],
        "mismatch_tokens": mismatch[1],
        "reward_sum": sum(s.reward for s in samples),
        "samples": len(samples),
        "tokens": sum(int(s.mask.sum()) for s in samples),  # model tokens: environment ones are context
        "turns": sum(s.turns for s in samples),
        "stale_samples": batch.counts["stale_samples"],  # what the groups dropped as stale held
        "stale_tokens": batch.counts["stale_tokens"],
        **dense("trained_bin", (int(s.mask.sum()) for s in samples)),  # their histograms: every rank every bin
        **dense("stale_bin", batch.stale_lengths),
    }


def dense(prefix: str, tokens) -> dict[str, int]:
    """Every bin of :data:`asyncrl.observe.lengths.BINS` as ``<prefix><i>``: the same names on every rank."""
    counts = lengths.histogram(tokens)
    return {f"{prefix}{i}": counts.get(i, 0) for i in range(len(lengths.BINS))}


def binned(total: dict, prefix: str) -> dict[int, int]:
    """The sparse histogram of the ``<prefix><i>`` sums."""
    return lengths.sparse({int(k.removeprefix(prefix)): v for k, v in total.items() if k.startswith(prefix)})


def step_record(version: int, out: StepLoss, total: dict, max_stale: float, lr: float, sync: dict) -> dict:
    """The ``metrics.jsonl`` record of the step that made ``version``, from the sums over every rank and
    ``sync``, the weight-sync probe's figure (``asyncrl.observe.probe.read_health``).

    ``learner/behaviour_logprob_mismatch``: mean |log pi - log mu| over the tokens the learner's own
    version sampled (:func:`behaviour_mismatch`), None when there were none (most steps at a lag of 1 or
    more); ``..._tokens``: how many. ``weights/probe_logprob_diff_max``: the largest difference between
    the learner's and any generator's log-probs of the probe over the last versions generators applied,
    None before the first compared: the sync-health figure, at every lag."""
    return {
        **out.metrics,  # the algorithm's: loss, correction, KL, critic
        "learner/version": version,
        "learner/tokens": total["tokens"],
        "learner/lr": lr,
        "learner/behaviour_logprob_mismatch": (
            total["mismatch_sum"] / total["mismatch_tokens"] if total["mismatch_tokens"] else None
        ),
        "learner/behaviour_logprob_mismatch_tokens": total["mismatch_tokens"],  # sampled by this version
        "weights/probe_logprob_diff_max": sync["probe_logprob_diff_max"],
        # a mixture of experts: the largest fraction of the probe's (layer, token) routed differently by an
        # engine than by the learner with the same weights, over the last versions applied
        **({"weights/probe_routing_diff_max": r} if (r := sync.get("probe_routing_diff_max")) is not None else {}),
        # versions a generator found its engine nearer the version before than the one applied (a broken sync)
        **({"weights/probe_sync_broken_versions": len(b)} if (b := sync.get("broken")) else {}),
        "learner/reward_mean": total["reward_sum"] / total["samples"],
        "learner/samples": total["samples"],
        # the lengths trained, against those dropped as stale (and generated: episodes/model_tokens): the bias
        # of dropping stale work, which falls on the slow episodes, most often the long ones (run/stats.py)
        "learner/tokens_per_sample": total["tokens"] / total["samples"],
        "learner/turns_per_sample": total["turns"] / total["samples"],
        "buffer/dropped_stale_samples": total["stale_samples"],
        "buffer/dropped_stale_tokens": total["stale_tokens"],
        "learner/tokens_hist": binned(total, "trained_bin"),  # by bin of asyncrl.observe.lengths
        "buffer/dropped_stale_tokens_hist": binned(total, "stale_bin"),
        "buffer/staleness_mean": total["stale_sum"] / total["groups"],
        "buffer/staleness_max": max_stale,
        "buffer/dropped_stale": total["dropped_stale"],
        "buffer/dead_letters": total["dead"],
        "buffer/foreign_entries": total["foreign"],
        "buffer/filtered_groups": total["filtered"],
        "buffer/replays": total["replays"],
    }
