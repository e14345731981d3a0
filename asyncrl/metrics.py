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
from typing import Protocol


class MetricsSink(Protocol):
    def log(self, record: dict) -> None: ...

    def close(self) -> None: ...


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


class MemorySink:
    """For tests: keeps records in a list."""

    def __init__(self):
        self.records: list[dict] = []

    def log(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def setup_logging(log_file: str | Path | None = None, name: str = "asyncrl", level: int = logging.INFO) -> None:
    """One format for every process: to its own file in the run directory, else stderr."""
    handler: logging.Handler = (
        logging.FileHandler(log_file) if log_file is not None else logging.StreamHandler(sys.stderr)
    )
    handler.setFormatter(logging.Formatter(f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
