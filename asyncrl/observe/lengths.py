"""How long the samples generated, trained and dropped as stale are: the length bias of dropping stale work.

A group dropped as stale is one that arrived too late, and the late ones are the slow episodes, most often the
long ones: a run that drops them trains on a shorter distribution than it generates. Each process counts its
samples' model tokens into one histogram shape (:data:`BINS`, quarter-octave bins, so any length is placed
within ~19% and the counts add across processes and steps): generators what they generated
(``episodes/model_tokens_hist``), learners what they trained (``learner/tokens_hist``) and what the groups
they dropped as stale held (``buffer/dropped_stale_tokens_hist``), each a sparse ``{bin: samples}`` in their
``metrics.jsonl`` records. :func:`compare` turns the run's totals into its figures: per kind the samples and the
median and 90th percentile, and between trained and generated the Kolmogorov-Smirnov statistic (the largest gap
between their cumulative shares, 0 for one distribution, 1 for disjoint ones; on these bins), beside the exact
means' ratio the summary already gives.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Mapping

# lower bounds of the bins, in model tokens a sample: 0, then 2 ** (i / 4) rounded, deduplicated, up to 2 ** 20
BINS: tuple[int, ...] = (0, *sorted({round(2 ** (i / 4)) for i in range(81)}))
KINDS = ("generated", "trained", "dropped_stale")
FIELDS = {  # kind -> its records' model tokens, samples and histogram
    "generated": ("episodes/model_tokens", "episodes/done", "episodes/model_tokens_hist"),
    "trained": ("learner/tokens", "learner/samples", "learner/tokens_hist"),
    "dropped_stale": (
        "buffer/dropped_stale_tokens",
        "buffer/dropped_stale_samples",
        "buffer/dropped_stale_tokens_hist",
    ),
}


def bin_of(tokens: int) -> int:
    """The index of the bin ``tokens`` falls in (the last one holds everything past it)."""
    return max(bisect.bisect_right(BINS, tokens) - 1, 0)


def histogram(lengths: Iterable[int]) -> dict[int, int]:
    """Sparse counts by bin index of ``lengths``."""
    return dict(collections.Counter(bin_of(int(n)) for n in lengths))


def sparse(dense: Mapping[int, float]) -> dict[int, int]:
    """The non-zero bins of ``dense`` (bin index -> count, floats from an all-reduce) as ints."""
    return {int(b): round(n) for b, n in dense.items() if round(n)}


def merge(into: collections.Counter, counts: Mapping) -> None:
    """Add a record's sparse histogram (JSON: its bin keys are strings) to ``into``."""
    for b, n in counts.items():
        into[int(b)] += int(n)


def quantile(counts: Mapping[int, int], q: float) -> int | None:
    """The lower bound of the bin holding the ``q`` quantile, None for no samples."""
    total = sum(counts.values())
    if not total:
        return None
    seen = 0
    for b in sorted(counts):
        seen += counts[b]
        if seen >= q * total:
            return BINS[b]
    return BINS[max(counts)]


def ks(a: Mapping[int, int], b: Mapping[int, int]) -> float | None:
    """The two-sample Kolmogorov-Smirnov statistic of two histograms: the largest difference between their
    cumulative shares at a bin's end. None when either is empty."""
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        return None
    gap = ca = cb = 0.0
    for i in sorted(set(a) | set(b)):
        ca, cb = ca + a.get(i, 0) / na, cb + b.get(i, 0) / nb
        gap = max(gap, abs(ca - cb))
    return gap


def compare(hists: Mapping[str, Mapping[int, int]]) -> dict:
    """The figures of the run's histograms by kind (:data:`KINDS`): ``<kind>_samples``, ``_p50``, ``_p90``
    (model tokens: the lower bound of the bin), and ``ks_trained_vs_generated``."""
    out: dict = {}
    for kind in KINDS:
        counts = hists.get(kind, {})
        out |= {f"{kind}_samples": sum(counts.values()), f"{kind}_p50": quantile(counts, 0.5),
                f"{kind}_p90": quantile(counts, 0.9)}  # fmt: skip
    out["ks_trained_vs_generated"] = ks(hists.get("trained", {}), hists.get("generated", {}))
    return out


class LengthBias:
    """A run's lengths by kind: model tokens and samples (exact means), and the histograms (:data:`BINS`)."""

    def __init__(self):
        self.sums = {kind: [0, 0] for kind in KINDS}  # kind -> [model tokens, samples]
        self.hists = {kind: collections.Counter() for kind in KINDS}

    def fold(self, record: dict) -> None:
        """A metrics record's figures of each kind it holds (:data:`FIELDS`; an older tree's may lack some). A
        figure of the wrong shape raises before anything changed."""
        sums, hists = {}, {}
        for kind, (tokens, samples, hist) in FIELDS.items():
            if record.get(tokens) is not None and record.get(samples) is not None:
                sums[kind] = (int(record[tokens]), int(record[samples]))
            hists[kind] = {int(b): int(n) for b, n in (record.get(hist) or {}).items()}
        for kind, (tokens, samples) in sums.items():
            self.sums[kind][0] += tokens
            self.sums[kind][1] += samples
        for kind, counts in hists.items():
            merge(self.hists[kind], counts)

    def summary(self) -> dict:
        """Mean model tokens per sample of each kind and ``trained_over_generated``: 1.0 when what the learners
        trained is as long as what the generators made; below, the shorter work trained and the longer dropped.
        With :func:`compare`'s figures and the histograms (``histograms``: kind -> {bin's lower bound: samples})."""
        mean = {k: (t / n if n else None) for k, (t, n) in self.sums.items()}
        generated, trained = mean["generated"], mean["trained"]
        ratio = trained / generated if generated and trained is not None else None
        hists = {kind: {str(BINS[b]): n for b, n in sorted(c.items())} for kind, c in self.hists.items()}
        return (
            {f"{k}_tokens_per_sample": v for k, v in mean.items()}
            | {"trained_over_generated": ratio}
            | compare(self.hists)
            | {"histograms": hists}
        )
