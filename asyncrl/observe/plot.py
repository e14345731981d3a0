"""``asyncrl plot``: one PNG dashboard of one or more runs, from their ``metrics.jsonl`` and ``summary.json``.

Ten panels: reward (greedy eval, each named eval set's greedy reward and pass@k, and the learner's sampled
batches) against version and wall time,
version against wall time, trained samples/s, the staleness of trained groups, weight sync seconds, the
engine-vs-learner log-prob gap with the same weights, buffer depth, learner step time (waiting for data vs
training) and failed episodes. Runs overlay, one
colour each. Wall time is minutes since a run's first record; a panel with nothing to draw says so.
Works on a live run too (``metrics.jsonl`` is appended to; a torn last line is skipped).
"""

from __future__ import annotations

import collections
import io
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.errors import UserError
from asyncrl.observe import lengths
from asyncrl.observe.metrics import read_metrics, set_figures

RATE_WINDOW = 5  # learner steps per samples/s point: one step's rate jumps with every slow batch


@dataclass
class Run:
    name: str
    records: list[dict]
    summary: dict = field(default_factory=dict)

    @property
    def t0(self) -> float:
        return min((r["time"] for r in self.records if isinstance(r.get("time"), int | float)), default=0.0)

    def minutes(self, record: dict) -> float:
        return (record["time"] - self.t0) / 60.0

    def having(self, *fields: str) -> list[dict]:
        """The records holding every one of ``fields`` as a number, in wall-time order where timed."""
        out = [r for r in self.records if all(isinstance(r.get(f), int | float) for f in fields)]
        return sorted(out, key=lambda r: r.get("time", 0.0)) if all("time" in r for r in out) else out


def load_run(run_dir: str | Path) -> Run:
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{run_dir} has no metrics.jsonl: give a run directory (runs/<name>)")
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}  # a live run, or one whose launcher was killed: the metrics still plot
    return Run(run_dir.name, read_metrics(metrics), summary if isinstance(summary, dict) else {})


def _import_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError("asyncrl plot needs matplotlib: pip install 'asyncrl[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, color="0.45", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _xy(ax, runs, colors, fields: tuple[str, str], x_time: bool, **style) -> bool:
    """One line per run of ``fields[1]`` against ``fields[0]`` (or wall time); whether any was drawn."""
    drawn = False
    for run, color in zip(runs, colors, strict=True):
        rows = run.having(fields[1], *(("time",) if x_time else (fields[0],)))
        if rows:
            xs = [run.minutes(r) if x_time else r[fields[0]] for r in rows]
            ax.plot(xs, [r[fields[1]] for r in rows], color=color, **style)
            drawn = True
    return drawn


def set_curves(runs) -> list[str]:
    """The named eval sets' curves the runs hold: ``eval/<name>/reward_mean`` and ``eval/<name>/pass@<k>``."""
    figures = {(n, m) for run in runs for r in run.records for n, f in set_figures(r).items() for m in f}
    return sorted(f"eval/{n}/{m}" for n, m in figures if m == "reward_mean" or m.startswith("pass@"))


def panel_reward(ax, runs, colors, x_time: bool) -> None:
    from matplotlib.lines import Line2D

    eval_drawn = _xy(ax, runs, colors, ("eval/version", "eval/reward_mean"), x_time, marker="o", lw=2)
    sampled = _xy(ax, runs, colors, ("learner/version", "learner/reward_mean"), x_time, lw=1, ls="--", alpha=0.7)
    ax.set_title(f"reward against {'wall time' if x_time else 'version'}")
    ax.set_xlabel("minutes" if x_time else "policy version")
    if not (eval_drawn or sampled):
        return _empty(ax, "no eval or learner records")
    handles = [Line2D([], [], color="k", marker="o", lw=2), Line2D([], [], color="k", ls="--", lw=1)]
    labels = ["greedy eval (the bar)", "sampled (trained batch)"]
    for i, key in enumerate(set_curves(runs)):  # each named set: a marker of its own, pass@k dotted
        style = {"marker": "sv^<>Dph"[i % 8], "lw": 1, "ls": ":" if "/pass@" in key else "-", "alpha": 0.8}
        if _xy(ax, runs, colors, ("eval/version", key), x_time, **style):
            handles.append(Line2D([], [], color="k", **style))
            labels.append(key.removeprefix("eval/").replace("/reward_mean", " greedy"))
    ax.legend(handles, labels, fontsize="small")


def panel_version(ax, runs, colors) -> None:
    ax.set_title("policy version against wall time")
    ax.set_xlabel("minutes")
    if not _xy(ax, runs, colors, ("time", "learner/version"), True, lw=2):
        _empty(ax, "no learner steps yet")


def samples_per_s(rows: list[dict], window: int = RATE_WINDOW) -> list[tuple[dict, float]]:
    """(record, trained samples/s over the ``window`` steps up to it) for learner step records in time
    order; the first ``window`` steps have no full window and no point."""
    out = []
    for i in range(window, len(rows)):
        span = rows[i]["time"] - rows[i - window]["time"]
        if span > 0:
            out.append((rows[i], sum(r["learner/samples"] for r in rows[i - window + 1 : i + 1]) / span))
    return out


def panel_samples(ax, runs, colors) -> None:
    ax.set_title(f"trained samples/s (over {RATE_WINDOW} steps)")
    ax.set_xlabel("minutes")
    drawn = False
    for run, color in zip(runs, colors, strict=True):
        points = samples_per_s(run.having("time", "learner/samples"))
        if points:
            ax.plot([run.minutes(r) for r, _ in points], [v for _, v in points], color=color, lw=2)
            drawn = True
    if not drawn:
        _empty(ax, f"fewer than {RATE_WINDOW + 1} learner steps")


def staleness_counts(run: Run) -> tuple[dict[int, int], str]:
    """Trained groups by staleness (the summary's histogram), else learner steps by their max staleness."""
    hist = run.summary.get("staleness_histogram") or {}
    if hist:
        return {int(k): int(v) for k, v in hist.items()}, "groups"
    steps = collections.Counter(int(r["buffer/staleness_max"]) for r in run.having("buffer/staleness_max"))
    return dict(steps), "steps (max)"


def panel_staleness(ax, runs, colors) -> None:
    ax.set_title("staleness of trained data")
    ax.set_xlabel("versions behind the learner")
    ax.set_ylabel("fraction")
    width, drawn = 0.8 / len(runs), False
    for i, (run, color) in enumerate(zip(runs, colors, strict=True)):
        counts, unit = staleness_counts(run)
        total = sum(counts.values())
        if total:
            ks = sorted(counts)
            xs = [k - 0.4 + width * (i + 0.5) for k in ks]
            ax.bar(xs, [counts[k] / total for k in ks], width=width, color=color, label=f"{run.name}: {unit}")
            drawn = True
    if not drawn:
        return _empty(ax, "no staleness recorded")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize="small")


def length_hists(run: Run) -> dict[str, dict[int, int]]:
    """Samples by bin of model tokens, by kind (generated, trained, dropped_stale): the records' histograms
    (a live run's too), by :data:`asyncrl.observe.lengths.BINS` index."""
    bias = lengths.LengthBias()
    for record in run.records:
        bias.fold(record)
    return bias.hists


def panel_lengths(ax, runs, colors) -> None:
    ax.set_title("model tokens a sample: generated (solid), trained (dashed),\ndropped as stale (dotted)")
    ax.set_xlabel("model tokens (bins of 2^(1/4))")
    ax.set_ylabel("cumulative share of samples")
    styles, drawn, notes = {"generated": "-", "trained": "--", "dropped_stale": ":"}, False, []
    for run, color in zip(runs, colors, strict=True):
        hists = length_hists(run)
        for kind, style in styles.items():
            counts, total = hists[kind], sum(hists[kind].values())
            if total:
                bins = sorted(counts)
                shares = itertools.accumulate(counts[b] / total for b in bins)
                ax.step([max(lengths.BINS[b], 1) for b in bins], list(shares), where="post", color=color, ls=style)
                drawn = True
        ks = lengths.ks(hists["trained"], hists["generated"])
        if ks is not None:
            notes.append(f"{run.name}: KS {ks:.3f}")
    if not drawn:
        return _empty(ax, "no lengths recorded")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.text(0.98, 0.02, "\n".join(notes), transform=ax.transAxes, ha="right", va="bottom", fontsize="small")


def panel_length_bias(ax, runs, colors) -> None:
    ax.set_title("length bias so far: mean trained / mean generated (solid),\nKS trained vs generated (dashed)")
    ax.set_xlabel("minutes")
    drawn = _xy(ax, runs, colors, ("time", "length/trained_over_generated"), True)
    drawn = _xy(ax, runs, colors, ("time", "length/ks_trained_vs_generated"), True, ls="--") or drawn
    if not drawn:
        return _empty(ax, "no length bias recorded")
    ax.axhline(1.0, color="0.6", lw=0.8)


def panel_sync(ax, runs, colors) -> None:
    ax.set_title("weight sync: step end to every generator serving it\n(dotted: the part an evaluation held it)")
    ax.set_xlabel("policy version")
    ax.set_ylabel("seconds")
    if not _xy(ax, runs, colors, ("weights/version", "weights/sync_seconds"), False, marker=".", lw=1):
        _empty(ax, "no weight sync records")
        return
    # of which the last generator waited for an evaluation holding its weights (dotted: eval points' spikes)
    _xy(ax, runs, colors, ("weights/version", "weights/sync_held_seconds"), False, lw=1, ls=":")


def panel_mismatch(ax, runs, colors) -> None:
    ax.set_title(
        "engine vs learner, same weights (the probe, each generator)\ndots: mean |log-prob difference|; x: largest"
    )
    ax.set_xlabel("policy version")
    versions = "generator/version"
    mean = _xy(ax, runs, colors, (versions, "weights/probe_logprob_diff_mean"), False, marker="o", ms=3, lw=0)
    # the largest: every probe's, the fixed one's (a VLM's, or a run before sampled probes) too
    if not _xy(ax, runs, colors, (versions, "weights/probe_logprob_diff"), False, marker="x", ms=4, lw=0) | mean:
        return _empty(ax, "no probe compared")
    ax.set_yscale("log")


def panel_buffer(ax, runs, colors) -> None:
    queued = _xy(ax, runs, colors, ("time", "buffer/queued"), True, lw=2)
    pending = _xy(ax, runs, colors, ("time", "buffer/pending"), True, lw=1, ls=":")
    ax.set_title("buffer depth (groups)")
    ax.set_xlabel("minutes")
    if not (queued or pending):
        return _empty(ax, "no buffer depth records\n(the launcher samples it at each learner step)")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="k", lw=2), Line2D([], [], color="k", lw=1, ls=":")]
    ax.legend(handles, ["queued", "read by learners, not yet acked"], fontsize="small")


def panel_step_time(ax, runs, colors) -> None:
    collect = _xy(ax, runs, colors, ("learner/version", "time/collect_s"), False, lw=2)
    train = _xy(ax, runs, colors, ("learner/version", "time/train_s"), False, lw=1, ls="--")
    ax.set_title("learner step time")
    ax.set_xlabel("policy version")
    ax.set_ylabel("seconds")
    if not (collect or train):
        return _empty(ax, "no learner step timings")
    ax.set_yscale("log")  # the first step waits for the generators' start-up: minutes, the others seconds
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 0.1, 1, 10: not 10^-1
    ax.yaxis.set_minor_formatter(NullFormatter())
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="k", lw=2), Line2D([], [], color="k", lw=1, ls="--")]
    ax.legend(handles, ["waiting for data", "training"], fontsize="small")


def failures(run: Run) -> dict[str, list[tuple[float, int]]]:
    """Cumulative failed episodes by cause, as (minutes, count): from 0 at the first generator report,
    a point at each report of a failure, and one at the last report."""
    reports = run.having("time", "episodes/done")
    totals: collections.Counter[str] = collections.Counter()
    out: dict[str, list[tuple[float, int]]] = {}
    for r in reports:
        for k, v in r.items():
            if k.startswith("episodes/failed_") and isinstance(v, int | float) and v:
                cause = k.removeprefix("episodes/failed_")
                totals[cause] += int(v)
                out.setdefault(cause, [(run.minutes(reports[0]), 0)]).append((run.minutes(r), totals[cause]))
    for cause, points in out.items():
        points.append((run.minutes(reports[-1]), totals[cause]))
    return out


def panel_failures(ax, runs, colors) -> None:
    ax.set_title("failed episodes (cumulative, by cause)")
    ax.set_xlabel("minutes")
    styles = ["-", "--", ":", "-."]
    notes = []
    for run, color in zip(runs, colors, strict=True):
        for i, (cause, points) in enumerate(sorted(failures(run).items())):
            ax.step([t for t, _ in points], [n for _, n in points], where="post", color=color, ls=styles[i % 4])
            ax.plot([], [], color=color, ls=styles[i % 4], label=f"{run.name}: {cause}")
        restarts = {k: v for k, v in (run.summary.get("restarts") or {}).items() if v}
        if restarts:
            notes.append(f"{run.name} restarts: " + ", ".join(f"{k} {v}" for k, v in restarts.items()))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    else:
        _empty(ax, "\n".join(["no failed episodes", *notes]))
        return
    if notes:
        ax.text(0.02, 0.98, "\n".join(notes), transform=ax.transAxes, va="top", fontsize="small", color="0.3")


def dashboard(run_dirs: list[str | Path], out: str | Path | None = None, dpi: int = 80) -> Path:
    """Write the dashboard of ``run_dirs`` to ``out`` (default: the first run's ``dashboard.png``)."""
    plt = _import_pyplot()
    runs = [load_run(d) for d in run_dirs]
    out = Path(out) if out is not None else Path(run_dirs[0]) / "dashboard.png"
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(runs))]
    fig, axes = plt.subplots(2, 6, figsize=(30, 9))
    panel_reward(axes[0, 0], runs, colors, x_time=False)
    panel_reward(axes[0, 1], runs, colors, x_time=True)
    panel_version(axes[0, 2], runs, colors)
    panel_samples(axes[0, 3], runs, colors)
    panel_staleness(axes[0, 4], runs, colors)
    panel_sync(axes[1, 0], runs, colors)
    panel_mismatch(axes[1, 1], runs, colors)
    panel_buffer(axes[1, 2], runs, colors)
    panel_step_time(axes[1, 3], runs, colors)
    panel_failures(axes[1, 4], runs, colors)
    panel_lengths(axes[0, 5], runs, colors)
    panel_length_bias(axes[1, 5], runs, colors)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    from matplotlib.patches import Patch

    fig.legend([Patch(color=c) for c in colors], [r.name for r in runs], loc="upper center", ncol=min(len(runs), 6))
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    out.parent.mkdir(parents=True, exist_ok=True)
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=dpi)
    plt.close(fig)
    from PIL import Image  # matplotlib's own dependency

    # 256 colours look the same for line plots and take about 40% of the bytes (~70 KB at 80 dpi)
    Image.open(image).convert("RGB").quantize(colors=256).save(out, format="PNG", optimize=True)
    return out
