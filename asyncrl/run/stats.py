"""Run statistics: what the launcher knows about a run. Metric records in, ``metrics.jsonl``,
``samples.jsonl`` and ``summary.json`` out, and the one live progress line."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import time
from pathlib import Path

from asyncrl.buffers.base import lost_groups, unfinished_groups
from asyncrl.config import RunConfig
from asyncrl.keys import LENGTH_BIAS_FIELD
from asyncrl.observe import lengths
from asyncrl.observe.metrics import DiskFull, open_sinks, read_metrics, set_figures
from asyncrl.run.disk import CheckpointRoom
from asyncrl.run.samples import ITEMS_FIELD, SamplesLog, sample_lines
from asyncrl.rundir import write_atomic


class WeightSync:
    """``weights/sync_seconds``: from the learner's step end that made version v to the moment every
    live generator serves v or newer (a generator may skip versions: newest wins); ``weights/sync_held_seconds``:
    how long the last of them to serve it had waited for an evaluation holding its weights (at an eval point,
    most of the figure: an evaluation sees one version).

    Times are wall clocks of different processes on one host. A generator is live while its last
    record is younger than ``live_s``; one that died does not hold the figure back.
    """

    def __init__(self, live_s: float = 30.0):
        self.live_s = live_s
        self.step_end: dict[int, float] = {}  # version -> learner wall clock at the end of its step
        self.serving: dict[str, list[tuple[int, float, float]]] = {}  # generator -> (version, applied at, held s)
        self.last_seen: dict[str, float] = {}
        self.done: set[int] = set()

    def fold(self, record: dict) -> list[dict]:
        """Take one metric record; return the sync records it completes."""
        source = record.get("source", "")
        if source.startswith("generator/"):
            self.last_seen[source] = record.get("time", time.time())
            if "weights/applied_at" in record:
                applied = (
                    record["generator/version"],
                    record["weights/applied_at"],
                    record.get("weights/held_seconds", 0),
                )
                self.serving.setdefault(source, []).append(applied)
        if "time/step_end_at" in record:
            version = record["learner/version"]
            self.step_end[version] = record["time/step_end_at"]
            self.done.discard(version)  # a learner restart makes this version again
        return self.complete(record.get("time", time.time()))

    def complete(self, now: float) -> list[dict]:
        live = [g for g, t in self.last_seen.items() if now - t < self.live_s and g in self.serving]
        out = []
        for version, end in sorted(self.step_end.items()):
            if version in self.done or not live:
                continue
            served = [min(((t, h) for v, t, h in self.serving[g] if v >= version and t >= end), default=None)
                      for g in live]  # fmt: skip
            if any(s is None for s in served):
                continue
            self.done.add(version)
            last, held = max(served)  # its wait may have begun before this version's step ended: the part after
            sync = last - end
            out.append(
                {"weights/version": version, "weights/sync_seconds": sync, "weights/sync_held_seconds": min(held, sync)}
            )
        return out


RECENT_STEPS = 11  # the ETA's step rate is over the last 10 steps: recent enough to follow a slowdown


class RunStats:
    """Folds the metric records of every process into the figures of the progress line and summary."""

    def __init__(self, run: RunConfig, run_dir: Path, resumed: bool = False):
        self.run = run
        self.started = time.time()
        previous = read_metrics(run_dir / "metrics.jsonl") if resumed else []
        self.cursor = "0-0"
        self.version = 0
        self.reward = None
        self.staleness_mean = 0.0
        self.max_staleness_seen = 0
        self.dropped_stale = 0
        self.samples = 0
        self.first_step_at: tuple[float, int] | None = None  # (learner wall, samples) after step 1
        self.last_step_at: tuple[float, int] | None = None
        self.wall_offset = 0.0
        self.evals: dict[int, float] = {}  # eval reward by the version evaluated
        self.eval_points: set[int] = set()  # the eval points those stand for (generators.evaluation)
        self.eval_sets: dict[str, dict[int, dict]] = {}  # named eval sets: their figures by the version evaluated
        self.eval_bar: str | None = None  # the named set that is the run's bar
        self.episodes = 0  # episodes generators finished (each report counts its own)
        self.lengths = lengths.LengthBias()  # generated (every training episode), trained, dropped as stale
        self.failures: collections.Counter[str] = collections.Counter()  # failed episodes by cause
        self.tool_failures: collections.Counter[str] = collections.Counter()  # failed tool calls by cause
        self.taken_over = {"groups": 0, "turns": 0}  # resumed from generators that died (generators.journal)
        self.generator_peaks = {"threads": 0, "child_processes": 0}  # of any one generator process
        self.error: str | None = None
        self.buffer: dict | None = None  # the buffer's counters at the end (pushed, trained, ..., lost)
        self.restarts: dict[str, int] = {}
        self.fleet: int | None = None  # live generators (the launcher counts their leases)
        self.weight_sync = WeightSync()
        self.sync_seconds: list[float] = []
        self.bad_records = 0  # metric records of the wrong shape (skipped)
        self.bad_records_read = 0  # metric entries that were not JSON objects (skipped by RunControl)
        self.staleness_histogram: dict[int, int] = {}  # trained groups by staleness, as of the last step
        self.recent_steps: collections.deque[tuple[float, int]] = collections.deque(maxlen=RECENT_STEPS)
        self.resumed_records = len(previous)
        for record in previous:  # the launch before this one: its figures count (nothing re-logged)
            with contextlib.suppress(KeyError, TypeError, ValueError):
                self._fold(record, None)
                self.weight_sync.fold(record)
        self.recent_steps.clear()  # the ETA is this launch's pace
        self.sink = open_sinks(run, run_dir, self.version)  # metrics.jsonl, tensorboard/, W&B
        self.samples_log = SamplesLog(run_dir)
        self.room = CheckpointRoom(run_dir / "checkpoint")
        self.disk_full: DiskFull | None = None  # from then on records are counted, not logged

    def skip_logged(self, control) -> None:
        """A resumed launch reads the metrics stream after what its predecessor wrote to metrics.jsonl:
        that launch trimmed the stream up to (and kept) the last entry it logged."""
        if self.resumed_records:  # else that launch logged nothing: read the stream from its start
            self.cursor = control.first_metrics_id() or self.cursor

    def drain(self, control, say=None, buffer=None) -> None:
        """Log the records the run's processes sent since the last drain (samples to ``samples.jsonl``);
        after a learner step, also the buffer's depth (``buffer/queued``, ``buffer/pending``: the launcher's
        own record, from ``buffer``); after a commit, the room for the next checkpoint (a record, and a
        line to ``say`` when it will not fit).

        A full disk raises DiskFull, once: this drain's lines are cut from metrics.jsonl (it holds whole
        drains, so a resumed launch, which reads the stream after the last entry trimmed, repeats none), and
        from then on records are only counted, neither logged nor trimmed from the stream."""
        try:
            cursor, records = control.read_metrics(self.cursor)
        except Exception:  # the run is ending because redis died; keep what we have
            return
        full_before, mark = self.disk_full, self.sink.primary.size()
        stepped = False
        for record in records:
            stepped = self._take(record, say) or stepped
        if stepped:
            self._sample_buffer(control, buffer)
        self.cursor = cursor
        self.bad_records_read = control.bad_metrics
        if self.disk_full is not None:
            if full_before is None:
                self.sink.primary.truncate(mark)
                raise self.disk_full
            return
        try:  # after the records are in metrics.jsonl: a launcher killed in between re-reads, never loses
            control.trim_metrics(cursor)
        except Exception:
            pass

    def _take(self, record: dict, say) -> bool:
        """One record folded into the figures and logged, with what it completes (weight syncs, the room for
        the next checkpoint); or skipped and counted. Whether it was a learner step."""
        try:
            if ITEMS_FIELD in record:  # what the model wrote: to samples.jsonl, not metrics.jsonl
                self._log(sample_lines(record), self.samples_log)
                return False
            self._fold(record, say)
            syncs = self.weight_sync.fold(record)
        except (KeyError, TypeError, ValueError):  # a record of the wrong shape: skipped, counted
            self.bad_records += 1
            return False
        self._log(record)
        for sync in syncs:
            self._log({"time": record.get("time", time.time()), **sync})
            self.sync_seconds.append(sync["weights/sync_seconds"])
        if "checkpoint/version" in record and self.disk_full is None:
            room, warning = self.room.after_commit(record)
            if room is not None:
                self._log(room)
            if warning is not None and say is not None:
                say(warning)
        return "learner/version" in record

    def _log(self, record, sink=None) -> None:
        """``record`` to ``sink`` (default: the metrics sinks), unless the disk filled."""
        if self.disk_full is not None:
            return
        try:
            (sink or self.sink).log(record)
        except DiskFull as exc:
            self.disk_full = exc

    def _sample_buffer(self, control, buffer) -> None:
        """Once per learner step: the staleness histogram of trained groups (for the summary) and the
        buffer's depth (a metric record); the length bias (a metric record, and the run's metadata for ``asyncrl
        status``). Redis or the buffer may be gone while the run ends."""
        bias = self.length_bias
        figures = {f"length/{k}": bias[k] for k in ("trained_over_generated", "ks_trained_vs_generated")}
        if any(v is not None for v in figures.values()):
            self._log({"time": time.time(), **{k: v for k, v in figures.items() if v is not None}})
        with contextlib.suppress(Exception):
            self.staleness_histogram = control.staleness_histogram()
            control.set_meta(LENGTH_BIAS_FIELD, json.dumps(_finite(bias)))
        if buffer is None:
            return
        try:
            counts = buffer.stats()
        except Exception:
            return
        self._log({"time": time.time(), "buffer/queued": counts["queued"], "buffer/pending": counts["pending"]})

    def _fold(self, record: dict, say) -> None:
        """Take one record; a field of the wrong shape raises before anything changed."""
        if "learner/version" in record:
            version, staleness_max = int(record["learner/version"]), int(record["buffer/staleness_max"])
            staleness_mean = float(record["buffer/staleness_mean"])
            dropped, samples = int(record["buffer/dropped_stale"]), int(record["learner/samples"])
            wall = float(record["learner/wall_seconds"])
            at = float(record.get("time", time.time()))
            self.version = version
            self.reward = record.get("learner/reward_mean", self.reward)
            self.staleness_mean = staleness_mean
            self.max_staleness_seen = max(self.max_staleness_seen, staleness_max)
            self.dropped_stale += dropped
            self.samples += samples
            if self.last_step_at is not None and wall + self.wall_offset < self.last_step_at[0]:
                self.wall_offset = self.last_step_at[0]  # the learners restarted; their clock did too
            point = (wall + self.wall_offset, self.samples)
            self.first_step_at = self.first_step_at or point
            self.last_step_at = point
            if self.recent_steps and version <= self.recent_steps[-1][1]:
                self.recent_steps.clear()  # the learners restarted from a checkpoint: a new pace
            self.recent_steps.append((at, version))
        if "episodes/done" in record:
            done = int(record["episodes/done"])
            causes = {
                k.removeprefix("episodes/failed_"): int(v)
                for k, v in record.items()
                if k.startswith("episodes/failed_")
            }
            self.episodes += done
            self.failures.update(causes)
            self.tool_failures.update(
                {k.removeprefix("tools/"): int(v) for k, v in record.items() if k.startswith("tools/")}
            )
            for name in self.taken_over:
                self.taken_over[name] += int(record.get(f"episodes/{name}_resumed", 0))
            for name in self.generator_peaks:
                peak = int(record.get(f"generator/{name}_peak", 0))
                self.generator_peaks[name] = max(self.generator_peaks[name], peak)
        if "eval/reward_mean" in record:
            version, reward = int(record["eval/version"]), float(record["eval/reward_mean"])
            points = [int(p) for p in record.get("eval/points") or [record.get("eval/point", version)]]
            named = set_figures(record)
            self.evals[version] = reward
            self.eval_points.update(points)
            for name, figures in named.items():
                self.eval_sets.setdefault(name, {})[version] = figures
            self.eval_bar = record.get("eval/bar", self.eval_bar)
            if say is not None:
                late = f" (eval point {', '.join(map(str, points))}: the first version served at or after it)"
                late = late if points != [version] else ""
                failed = f", {record['eval/failed']} episodes failed" if record.get("eval/failed") else ""
                exact = f"exact {record['eval/exact_rate']:.2f}{failed}"
                sets = "".join(f"; {n}: " + ", ".join(f"{m} {v:.3f}" for m, v in f.items()) for n, f in named.items())
                say(f"eval at version {version}{late}: reward {reward:.3f} ({exact}){sets}")
        self.lengths.fold(record)  # last: the branches above raise before they change anything, and it too

    @property
    def length_bias(self) -> dict:
        """summary.json's ``length_bias`` (:meth:`asyncrl.observe.lengths.LengthBias.summary`)."""
        return self.lengths.summary()

    @property
    def samples_per_s(self) -> float | None:
        """Trained samples per second between the first and the last learner step (start-up excluded)."""
        if self.first_step_at is None or self.last_step_at is self.first_step_at:
            return None
        (t0, s0), (t1, s1) = self.first_step_at, self.last_step_at
        return (s1 - s0) / max(t1 - t0, 1e-9)

    @property
    def initial_eval_reward(self) -> float | None:
        return self.evals.get(0)

    @property
    def final_eval_reward(self) -> float | None:
        return self.evals.get(self.run.steps)

    @property
    def last_eval(self) -> tuple[int | None, float | None]:
        """(version, reward) of the newest evaluation: the final one, or where an interrupted run got."""
        if not self.evals:
            return None, None
        version = max(self.evals)
        return version, self.evals[version]

    def summary(self, exit_reason: str) -> dict:
        last_version, last_reward = self.last_eval
        return {
            "initial_eval_reward": self.initial_eval_reward,
            "final_eval_reward": self.final_eval_reward,
            "last_eval_version": last_version,
            "last_eval_reward": last_reward,
            "final_version": self.version,
            "steps": self.run.steps,
            "max_staleness_seen": self.max_staleness_seen,
            "max_policy_lag": self.run.max_policy_lag,
            "samples_per_s": self.samples_per_s,
            "samples_trained": self.samples,
            "dropped_stale": self.dropped_stale,
            "length_bias": self.length_bias,
            "evals": {str(k): v for k, v in sorted(self.evals.items())},
            "eval_bar": self.eval_bar,
            "eval_sets": {n: {str(k): v for k, v in sorted(by.items())} for n, by in self.eval_sets.items()},
            "episodes": self.episodes,
            "episodes_failed": dict(sorted(self.failures.items())),
            "tool_calls_failed": dict(sorted(self.tool_failures.items())),
            "episodes_resumed": self.taken_over,
            "generator_peaks": self.generator_peaks,
            "weights_sync_seconds": _quantiles(self.sync_seconds),
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness_histogram.items())},
            "buffer": self.buffer,
            "restarts": self.restarts,
            "wall_seconds": time.time() - self.started,
            "exit_reason": exit_reason,
            "error": self.error,
            "bad_metric_records": self.bad_records + self.bad_records_read,
        }

    def write_summary(self, run_dir: Path, exit_reason: str, say=None) -> dict:
        """``summary.json``. If even that cannot be written (a disk full past the launcher's reserve), the
        summary goes to ``say`` as one line of JSON instead (raised without ``say``), and summary.json stays
        as it was: absent, or a resumed run's previous one, never half written."""
        self.sink.close()
        self.samples_log.close()
        summary = self.summary(exit_reason)
        # valid JSON whatever a metric held: a non-finite number is written as null
        try:
            write_atomic(run_dir / "summary.json", json.dumps(_finite(summary), indent=2, allow_nan=False) + "\n")
        except OSError as exc:
            (run_dir / "summary.json.tmp").unlink(missing_ok=True)
            if say is None:
                raise
            say(f"summary.json not written ({exc.strerror}); the summary: {json.dumps(_finite(summary))}")
        return summary


def final_buffer_stats(buffer, say) -> dict | None:
    """The buffer's counters at the end of a run, for the summary (None without them: the summary is written
    even when the buffer is gone, which ``say`` tells)."""
    if buffer is None:
        return None
    try:
        counts = buffer.stats()
    except Exception as exc:
        say(f"buffer statistics unavailable at the end: {exc}")
        return None
    orphans = buffer.orphans()  # unfinished groups a later generator (or --resume) can take up where they were
    return {**counts, "lost": lost_groups(counts), "unfinished": unfinished_groups(counts), "orphans": orphans}


def summary_line(name: str, summary: dict, run_dir: Path) -> str:
    """The launcher's last line. Its evaluations: the first and the final one; for a run that stopped
    before its final evaluation, the last one there was and its version (``0.227 -> 0.383 at version 20
    of 40``)."""
    first, last = _fmt(summary["initial_eval_reward"]), summary["last_eval_version"]
    evals = f"{first} -> {_fmt(summary['final_eval_reward'])}"
    if summary["final_eval_reward"] is None and last:  # one after the first
        evals = f"{first} -> {_fmt(summary['last_eval_reward'])} at version {last} of {summary['steps']}"
    return (
        f"run {name}: version {summary['final_version']}, eval reward {evals}, max staleness "
        f"{summary['max_staleness_seen']}, {_fmt(summary['samples_per_s'], '.1f')} samples/s; see {run_dir}"
    )


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _finite(obj):
    """``obj`` with every NaN or infinity (at any depth) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _top(counts: collections.Counter, n: int = 2) -> str:
    """``cause N, cause M``: the most frequent causes."""
    return ", ".join(f"{cause} {k}" for cause, k in counts.most_common(n))


def _quantiles(values: list[float]) -> dict | None:
    if not values:
        return None
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"median": pick(0.5), "p90": pick(0.9), "max": ordered[-1], "versions": len(ordered)}


def eta_seconds(recent_steps, steps: int, now: float) -> float | None:
    """Seconds until version ``steps``, at the pace of ``recent_steps`` ((wall clock, version) of the
    last learner steps), counting down since the newest; None before two steps."""
    if len(recent_steps) < 2:
        return None
    (t0, v0), (t1, v1) = recent_steps[0], recent_steps[-1]
    if v1 <= v0 or t1 <= t0:
        return None
    return max(0.0, (steps - v1) * (t1 - t0) / (v1 - v0) - (now - t1))


def format_eta(seconds: float | None) -> str:
    """``ETA 42s``, ``ETA 3m05s``, ``ETA 2h07m``; ``ETA -`` when unknown."""
    if seconds is None:
        return "ETA -"
    s = round(seconds)
    if s < 60:
        return f"ETA {s}s"
    if s < 3600:
        return f"ETA {s // 60}m{s % 60:02d}s"
    return f"ETA {s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """One live line: version, reward, staleness, samples/s, ETA. Silent without a console."""

    def __init__(self, console, steps: int):
        self.console = console
        self.steps = steps
        self._progress = None

    def __enter__(self) -> Progress:
        if self.console is not None:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._progress = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._progress.start()
            self._task = self._progress.add_task("version", total=self.steps, info="starting")
        return self

    def update(self, stats: RunStats) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=stats.version, info=self.info(stats, time.time()))

    def info(self, stats: RunStats, now: float) -> str:
        reward = "-" if stats.reward is None else f"{stats.reward:.3f}"
        rate = stats.samples_per_s
        eta = format_eta(eta_seconds(stats.recent_steps, self.steps, now))
        info = (
            f"reward {reward}  staleness {stats.staleness_mean:.2f} (max {stats.max_staleness_seen})  "
            f"{'-' if rate is None else f'{rate:.0f}'} samples/s  {eta}"
        )
        if stats.fleet is not None:
            info += f"  {stats.fleet} generators"
        if stats.failures:
            info += f"  [red]failed {sum(stats.failures.values())}[/] ({_top(stats.failures)})"
        return info

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
