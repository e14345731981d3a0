"""Run statistics: what the launcher knows about a run. Metric records in, ``metrics.jsonl`` and
``summary.json`` out, and the one live progress line."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import time
from pathlib import Path

from asyncrl.config import RunConfig
from asyncrl.observe.metrics import open_sinks, read_metrics
from asyncrl.rundir import write_atomic


class WeightSync:
    """``weights/sync_seconds``: from the learner's step end that made version v to the moment every
    live generator serves v or newer (a generator may skip versions: newest wins).

    Times are wall clocks of different processes on one host. A generator is live while its last
    record is younger than ``live_s``; one that died does not hold the figure back.
    """

    def __init__(self, live_s: float = 30.0):
        self.live_s = live_s
        self.step_end: dict[int, float] = {}  # version -> learner wall clock at the end of its step
        self.serving: dict[str, list[tuple[int, float]]] = {}  # generator -> (version, applied at)
        self.last_seen: dict[str, float] = {}
        self.done: set[int] = set()

    def fold(self, record: dict) -> list[dict]:
        """Take one metric record; return the sync records it completes."""
        source = record.get("source", "")
        if source.startswith("generator/"):
            self.last_seen[source] = record.get("time", time.time())
            if "weights/applied_at" in record:
                self.serving.setdefault(source, []).append((record["generator/version"], record["weights/applied_at"]))
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
            served = [min((t for v, t in self.serving[g] if v >= version and t >= end), default=None) for g in live]
            if any(t is None for t in served):
                continue
            self.done.add(version)
            out.append({"weights/version": version, "weights/sync_seconds": max(served) - end})
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
        self.evals: dict[int, float] = {}
        self.episodes = 0  # episodes generators finished (each report counts its own)
        self.failures: collections.Counter[str] = collections.Counter()  # failed episodes by cause
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

    def skip_logged(self, control) -> None:
        """A resumed launch reads the metrics stream after what its predecessor wrote to metrics.jsonl:
        that launch trimmed the stream up to (and kept) the last entry it logged."""
        if self.resumed_records:  # else that launch logged nothing: read the stream from its start
            self.cursor = control.first_metrics_id() or self.cursor

    def drain(self, control, on_eval=None, buffer=None) -> None:
        """Log the records the run's processes sent since the last drain; after a learner step, also the
        buffer's depth (``buffer/queued``, ``buffer/pending``: the launcher's own record, from ``buffer``)."""
        try:
            cursor, records = control.read_metrics(self.cursor)
        except Exception:  # the run is ending because redis died; keep what we have
            return
        stepped = False
        for record in records:
            try:
                self._fold(record, on_eval)
                syncs = self.weight_sync.fold(record)
            except (KeyError, TypeError, ValueError):  # a record of the wrong shape: skipped, counted
                self.bad_records += 1
                continue
            self.sink.log(record)
            stepped = stepped or "learner/version" in record
            for sync in syncs:
                self.sink.log({"time": record.get("time", time.time()), **sync})
                self.sync_seconds.append(sync["weights/sync_seconds"])
        if stepped:
            self._sample_buffer(control, buffer)
        self.cursor = cursor
        self.bad_records_read = control.bad_metrics
        try:  # after the records are in metrics.jsonl: a launcher killed in between re-reads, never loses
            control.trim_metrics(cursor)
        except Exception:
            pass

    def _sample_buffer(self, control, buffer) -> None:
        """Once per learner step: the staleness histogram of trained groups (for the summary) and the
        buffer's depth (a metric record). Either may be gone while the run ends."""
        with contextlib.suppress(Exception):
            self.staleness_histogram = control.staleness_histogram()
        if buffer is None:
            return
        try:
            counts = buffer.stats()
        except Exception:
            return
        self.sink.log({"time": time.time(), "buffer/queued": counts["queued"], "buffer/pending": counts["pending"]})

    def _fold(self, record: dict, on_eval) -> None:
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
        if "eval/reward_mean" in record:
            self.evals[int(record["eval/version"])] = float(record["eval/reward_mean"])
            if on_eval is not None:
                failed = f", {record['eval/failed']} episodes failed" if record.get("eval/failed") else ""
                on_eval(
                    f"eval at version {record['eval/version']}: reward {record['eval/reward_mean']:.3f} "
                    f"(exact {record['eval/exact_rate']:.2f}{failed})"
                )

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

    def summary(self, exit_reason: str) -> dict:
        return {
            "initial_eval_reward": self.initial_eval_reward,
            "final_eval_reward": self.final_eval_reward,
            "final_version": self.version,
            "max_staleness_seen": self.max_staleness_seen,
            "max_policy_lag": self.run.max_policy_lag,
            "samples_per_s": self.samples_per_s,
            "samples_trained": self.samples,
            "dropped_stale": self.dropped_stale,
            "evals": {str(k): v for k, v in sorted(self.evals.items())},
            "episodes": self.episodes,
            "episodes_failed": dict(sorted(self.failures.items())),
            "weights_sync_seconds": _quantiles(self.sync_seconds),
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness_histogram.items())},
            "buffer": self.buffer,
            "restarts": self.restarts,
            "wall_seconds": time.time() - self.started,
            "exit_reason": exit_reason,
            "error": self.error,
            "bad_metric_records": self.bad_records + self.bad_records_read,
        }

    def write_summary(self, run_dir: Path, exit_reason: str) -> dict:
        self.sink.close()
        summary = self.summary(exit_reason)
        # valid JSON whatever a metric held: a non-finite number is written as null
        write_atomic(run_dir / "summary.json", json.dumps(_finite(summary), indent=2, allow_nan=False) + "\n")
        return summary


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
