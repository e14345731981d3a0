"""Metrics sinks and the one logging setup.

Child processes emit namespaced records (``learner/loss``, ``generator/tokens_per_s``,
``buffer/staleness_mean``) through :class:`RedisSink`; the launcher is the single writer of
``metrics.jsonl`` (:class:`JsonlSink`), so records from many processes never interleave mid-line.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path


class JsonlSink:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = self.path.open("a", buffering=1)

    def log(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._f.close()


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
