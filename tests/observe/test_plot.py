"""`asyncrl plot`: one PNG of one or more runs from their metrics files, with no launch; a panel with
nothing to draw says so; without matplotlib or a run directory, one clear error."""

from __future__ import annotations

import sys

import matplotlib
import pytest
from metrics_fixtures import demo_records, write_run
from PIL import Image

from asyncrl.cli import main
from asyncrl.errors import UserError
from asyncrl.observe import lengths
from asyncrl.observe.plot import (
    dashboard,
    load_run,
    panel_buffer,
    panel_failures,
    panel_length_bias,
    panel_lengths,
    panel_mismatch,
    panel_staleness,
    samples_per_s,
)

matplotlib.use("Agg")


def plot(*argv: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plot", *argv])
    assert exit_.value.code == 0


def test_two_runs_overlay_in_one_png(tmp_path, capsys):
    summary = {"staleness_histogram": {"0": 30, "1": 34}, "restarts": {"generators": 1}}
    a = write_run(tmp_path / "A", demo_records(), summary)
    b = write_run(tmp_path / "B", demo_records(steps=12, failed=False))  # live: no summary.json yet
    plot(str(a), str(b), "-o", str(tmp_path / "both.png"))
    assert capsys.readouterr().out.strip() == str(tmp_path / "both.png")
    with Image.open(tmp_path / "both.png") as png:
        assert png.format == "PNG" and png.size == (2400, 720)  # 30 x 9 inches at 80 dpi
    plot(str(a))
    with Image.open(a / "dashboard.png") as png:  # the default: in the first run's directory
        assert png.size == (2400, 720)


def panel_texts(panel, run_dir) -> list[str]:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    panel(ax, [load_run(run_dir)], ["C0"])
    texts = [t.get_text() for t in ax.texts]
    plt.close(fig)
    return texts


def test_panels_with_no_data_say_so(tmp_path):
    bare = write_run(tmp_path / "bare", [{"fleet/generators": 1, "time": 1.0}])
    assert panel_texts(panel_buffer, bare)[0].startswith("no buffer depth records")
    assert panel_texts(panel_staleness, bare) == ["no staleness recorded"]
    assert panel_texts(panel_failures, bare) == ["no failed episodes"]
    assert panel_texts(panel_mismatch, bare) == ["no probe compared"]
    assert panel_texts(panel_lengths, bare) == ["no lengths recorded"]
    assert panel_texts(panel_length_bias, bare) == ["no length bias recorded"]
    dashboard([bare])  # every panel empty: still one PNG
    assert (bare / "dashboard.png").stat().st_size > 0
    full = write_run(tmp_path / "full", demo_records())
    assert panel_texts(panel_buffer, full) == [] and panel_texts(panel_failures, full) == []
    assert panel_texts(panel_mismatch, full) == []


def test_rates_and_histogram_come_from_the_records(tmp_path):
    run = load_run(write_run(tmp_path / "A", demo_records(steps=8)))
    rates = samples_per_s(run.having("time", "learner/samples"), window=5)
    assert [r["learner/version"] for r, _ in rates] == [6, 7, 8]
    assert [v for _, v in rates] == pytest.approx([5 * 64 / 15] * 3)  # a step every 3 s, 64 samples each
    from asyncrl.observe.plot import staleness_counts

    assert staleness_counts(run) == ({0: 4, 1: 4}, "steps (max)")  # no summary: the steps' max staleness
    run.summary = {"staleness_histogram": {"0": 5, "2": 1}}
    assert staleness_counts(run) == ({0: 5, 2: 1}, "groups")


def test_bad_input_is_one_clear_error(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="has no metrics.jsonl"):
        dashboard([tmp_path / "nothing"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(UserError, match=r"pip install 'asyncrl\[plot\]'"):
        dashboard([write_run(tmp_path / "A", demo_records())])


def test_the_lengths_panels_draw_each_kinds_distribution_and_name_the_ks_statistic(tmp_path):
    # generated: 10 samples of 8 tokens and 10 of 32; trained: the 8-token ones only; dropped: the 32-token ones
    short, long = lengths.bin_of(8), lengths.bin_of(32)
    records = [
        {"time": 1.0, "source": "generator/0", "episodes/model_tokens_hist": {str(short): 10, str(long): 10}},
        {"time": 2.0, "source": "learner/0", "learner/tokens_hist": {str(short): 10},
         "buffer/dropped_stale_tokens_hist": {str(long): 10}},
        {"time": 2.5, "length/trained_over_generated": 0.4, "length/ks_trained_vs_generated": 0.5},
    ]  # fmt: skip
    run = write_run(tmp_path / "biased", records)
    assert panel_texts(panel_lengths, run) == ["biased: KS 0.500"]
    assert panel_texts(panel_length_bias, run) == []
