"""The length histograms (``asyncrl.observe.lengths``): bins every length falls in once, quantiles at bin
bounds, and the two-sample Kolmogorov-Smirnov statistic on them against the definition on the raw lengths."""

from __future__ import annotations

import random

import pytest

from asyncrl.observe import lengths


def test_every_length_falls_in_one_bin_within_a_fifth_of_its_size():
    assert lengths.BINS[:12] == (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13)
    for n in range(0, 5000):
        b = lengths.bin_of(n)
        low = lengths.BINS[b]
        high = lengths.BINS[b + 1] if b + 1 < len(lengths.BINS) else None
        assert low <= n and (high is None or n < high)
        assert high is None or high - low <= max(1, 0.2 * high)
    assert lengths.bin_of(10**9) == len(lengths.BINS) - 1  # past the last bound: the last bin


def test_histograms_merge_as_sums_and_quantiles_read_bin_bounds():
    counts = lengths.histogram([1, 1, 8, 9, 33])
    into = __import__("collections").Counter()
    lengths.merge(into, {str(b): n for b, n in counts.items()})  # as a JSON record carries it
    lengths.merge(into, counts)
    assert sum(into.values()) == 10
    assert lengths.quantile(into, 0.5) == 8 and lengths.quantile(into, 0.9) == 32 and lengths.quantile({}, 0.5) is None
    assert lengths.sparse({3: 2.0, 4: 0.0, 5: 1e-9}) == {3: 2}


def ks_of(a: list[int], b: list[int]) -> float:
    """The definition: the largest gap between the two empirical CDFs, over every value either holds."""
    return max(abs(sum(x <= v for x in a) / len(a) - sum(x <= v for x in b) / len(b)) for v in set(a) | set(b))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ks_on_the_bins_is_the_raw_statistic_for_lengths_that_fill_whole_bins(seed):
    rng = random.Random(seed)
    a = [rng.choice((1, 2, 3, 4, 5, 6, 7, 8)) for _ in range(300)]  # bins of one value each: nothing lost
    b = [rng.choice((1, 2, 3, 4, 5, 6, 7, 8, 8, 8)) for _ in range(200)]
    want = ks_of(a, b)
    assert want > 0
    assert lengths.ks(lengths.histogram(a), lengths.histogram(b)) == pytest.approx(want, abs=1e-12)
    assert lengths.ks(lengths.histogram(a), lengths.histogram(a)) == 0.0
    assert lengths.ks(lengths.histogram([1]), lengths.histogram([100])) == 1.0
    assert lengths.ks({}, lengths.histogram(a)) is None
