"""Metrics sinks and the one logging setup.

Child processes emit namespaced records (``learner/loss``, ``generator/tokens_per_s``,
``buffer/staleness_mean``) through :class:`RedisSink`; the launcher is the single writer of
``metrics.jsonl`` (:class:`JsonlSink`), so records from many processes never interleave mid-line.
It logs the same records to TensorBoard event files in ``runs/<name>/tensorboard/``
(:class:`TensorBoardSink`) and, with ``run.wandb: offline``, to a Weights & Biases offline run
(:class:`WandbSink`): every numeric field a scalar under its own name, at the record's policy version.

A full disk is one error, :class:`DiskFull`, naming the file and the space left; ``metrics.jsonl`` keeps
whole lines only (a line the disk cannot hold is cut back, never left torn).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from asyncrl.errors import UserError

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # no space left, or the user's quota spent: the same to a run


class DiskFull(UserError):
    """No space left where the run writes: one line naming the path and the space still free there."""

    def __init__(self, path: str | Path, hint: str = ""):
        self.path = Path(path)
        where = f"in {path}" if self.path.is_dir() else f"writing {path}"
        super().__init__(f"no space left on device {where} ({human_bytes(free_bytes(path))} free there){hint}")


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path`` (or its nearest
    existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def human_bytes(n: float) -> str:
    """``812 B``, ``3.1 MB``, ``1.2 GB``: decimal units, as the ``*_gb`` metrics count."""
    if n < 1000:
        return f"{int(n)} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if n < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} TB"


# the field that names a record's policy version, by kind of record (the first one present wins)
VERSION_FIELDS = ("learner/version", "eval/version", "generator/version", "weights/version", "checkpoint/version")


def scalars(record: dict) -> dict[str, float]:
    """The record's numeric fields, by name. Not ``time`` (the wall time of the point) nor ``*_at``
    fields: absolute clocks, which a float32 scalar rounds to minutes."""
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k != "time" and not k.endswith("_at")
    }


class _Stepper:
    """A record's step: its own policy version, else the newest learner version logged before it
    (records of no version, such as the buffer's, plot where the run was; a resumed launch starts
    from the version its predecessor logged last)."""

    def __init__(self, version: int = 0) -> None:
        self.version = version

    def step(self, record: dict) -> int:
        for field in VERSION_FIELDS:
            if isinstance(record.get(field), int | float):
                if field == "learner/version":
                    self.version = int(record[field])
                return int(record[field])
        return self.version


class JsonlSink:
    """One JSON line per record, appended unbuffered: each line is on disk whole when ``log`` returns, or
    (:class:`DiskFull`) not at all."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = self.path.open("ab", buffering=0)

    def log(self, record: dict) -> None:
        start = self.size()
        data = memoryview((json.dumps(record) + "\n").encode())
        try:
            while data:
                data = data[self._f.write(data) :]
        except OSError as exc:
            self.truncate(start)
            if is_disk_full(exc):
                raise DiskFull(self.path) from None
            raise

    def size(self) -> int:
        return self._f.seek(0, os.SEEK_END)

    def truncate(self, size: int) -> None:
        """Cut the file back to ``size`` bytes (a mark of :meth:`size`): lines written since are gone."""
        with contextlib.suppress(OSError):  # shrinking a file needs no space
            self._f.truncate(size)

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    """TensorBoard scalars of every record, to a new events file in ``logdir`` per launch."""

    def __init__(self, logdir: str | Path, version: int = 0):
        from asyncrl.observe.tensorboard import EventWriter

        self.path = Path(logdir)
        self.writer = EventWriter(logdir)
        self.stepper = _Stepper(version)

    def log(self, record: dict) -> None:
        step = self.stepper.step(record)
        self.writer.scalars(step, scalars(record), float(record.get("time") or time.time()))

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Every record to a Weights & Biases run: its scalars and ``version`` (the x axis every namespace
    is plotted against: records of different processes arrive out of version order, so W&B's own
    monotonic step cannot be the version)."""

    def __init__(self, run, version: int = 0):
        self.run = run
        self.stepper = _Stepper(version)
        self.defined: set[str] = set()
        run.define_metric("version")

    def log(self, record: dict) -> None:
        values = scalars(record)
        if not values:
            return
        for name in values:
            pattern = f"{name.split('/', 1)[0]}/*" if "/" in name else name
            if pattern not in self.defined:  # W&B globs are prefixes only: one per namespace
                self.run.define_metric(pattern, step_metric="version")
                self.defined.add(pattern)
        self.run.log({**values, "version": self.stepper.step(record)})

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() returns when the run's exit is answered, not when wandb-core has written the .wandb file
        # (a buffered writer flushed apart from that answer: header-only on a loaded machine); teardown
        # waits for wandb-core to exit, so on return the offline run is whole (atexit would do it later)
        wandb.teardown()


def check_wandb(mode: str) -> None:
    """``run.wandb`` can be served here (without importing wandb: that takes seconds); else one error."""
    import importlib.util

    if mode != "off" and importlib.util.find_spec("wandb") is None:
        raise UserError(f"run.wandb is {mode!r} but wandb is not installed: pip install 'asyncrl[wandb]'")


def open_wandb(mode: str, run_dir: Path, name: str, config: dict, version: int = 0) -> WandbSink:
    """A W&B run of this launch in ``run_dir/wandb`` (``wandb sync`` uploads it later)."""
    check_wandb(mode)
    import wandb

    # silent, and console="off": W&B must not wrap the launcher's stdout and stderr (its live line)
    settings = wandb.Settings(silent=True, console="off", disable_git=True)
    run = wandb.init(
        mode=mode, dir=str(run_dir), project="asyncrl", name=name, group=name, config=config, settings=settings
    )
    return WandbSink(run, version)


class Sinks:
    """Each record to ``primary`` (``metrics.jsonl``: its errors are the caller's) and to every extra
    sink; an extra sink that fails is logged once and dropped, so a viewer's file never stops a run. A
    full disk does stop it (:class:`DiskFull`): ``metrics.jsonl`` is on the same one."""

    def __init__(self, primary, *extras):
        self.primary = primary
        self.extras = list(extras)

    def log(self, record: dict) -> None:
        self.primary.log(record)
        for sink in list(self.extras):
            try:
                sink.log(record)
            except Exception as exc:
                self.extras.remove(sink)
                with contextlib.suppress(Exception):  # its file closed now, not with a warning at exit
                    sink.close()
                if is_disk_full(exc):
                    raise DiskFull(getattr(sink, "path", type(sink).__name__)) from None
                logging.getLogger(__name__).error("metrics sink %s failed: dropped", type(sink).__name__, exc_info=exc)

    def close(self) -> None:
        self.primary.close()
        for sink in self.extras:
            try:
                sink.close()
            except Exception as exc:  # the run is over and metrics.jsonl is whole: say so, do not fail the exit
                logger = logging.getLogger(__name__)
                if is_disk_full(exc):  # the run said so already: no traceback
                    logger.warning("metrics sink %s: %s", type(sink).__name__, exc)
                else:
                    logger.error("metrics sink %s failed to close", type(sink).__name__, exc_info=exc)


def open_sinks(run, run_dir: Path, version: int = 0) -> Sinks:
    """The launcher's sinks for ``run`` (a ``RunConfig``): ``metrics.jsonl`` (appended to: a resumed
    run's history goes on), ``tensorboard/`` (a new events file per launch), and W&B if asked for.
    ``version``: the last learner version of the launch this one resumes."""
    extras: list = [TensorBoardSink(run_dir / "tensorboard", version)]
    if run.wandb != "off":
        extras.append(open_wandb(run.wandb, run_dir, run.name, run.model_dump(), version))
    return Sinks(JsonlSink(run_dir / "metrics.jsonl"), *extras)


def read_metrics(path: Path) -> list[dict]:
    """The JSON-object lines of ``path`` (none if it is missing; a torn last line is skipped)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


SET_FIGURES = ("reward_mean", "exact_rate", "mean@", "pass@")  # of a named eval set: what the summary keeps


def set_figures(record: dict) -> dict[str, dict[str, float]]:
    """An eval record's named sets' figures, ``{name: {"reward_mean": .., "pass@4": ..}}`` (one unnamed set: none)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in record.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and parts[2].startswith(SET_FIGURES):
            out.setdefault(parts[1], {})[parts[2]] = float(value)
    return out


class RedisSink:
    """Sends records to the launcher through the run's Redis ``metrics`` stream."""

    def __init__(self, control, source: str):
        self.control = control
        self.source = source

    def log(self, record: dict) -> None:
        self.control.emit({"time": time.time(), "source": self.source, **record})

    def close(self) -> None:
        pass


class Timings:
    """Named phase timings of a loop (torchbeast's ``prof.Timings`` habit): ``reset()`` at the top of an
    iteration, ``time("collect")`` at the end of each phase records the seconds since the last mark."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def reset(self) -> None:
        self.seconds = {}
        self._last = time.perf_counter()

    def time(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def record(self, prefix: str = "time/") -> dict[str, float]:
        """``{"time/<phase>_s": seconds}`` of the current iteration."""
        return {f"{prefix}{phase}_s": s for phase, s in self.seconds.items()}


def setup_logging(log_file: str | Path | None = None, name: str = "asyncrl", level: int = logging.INFO) -> None:
    """One format for every process: to its own file in the run directory, else stderr."""
    handler: logging.Handler = (
        logging.FileHandler(log_file) if log_file is not None else logging.StreamHandler(sys.stderr)
    )
    handler.setFormatter(logging.Formatter(f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
