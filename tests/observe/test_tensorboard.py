"""The launcher's TensorBoard files, read back with TensorBoard's own reader: every numeric field of
every record a scalar under its name, at the record's policy version and wall time; a resumed run adds
a file and leaves the old one byte for byte."""

from __future__ import annotations

import json
import struct

import pytest
from metrics_fixtures import demo_records
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from asyncrl.config import RunConfig
from asyncrl.observe.metrics import read_metrics
from asyncrl.observe.tensorboard import crc32c, masked_crc32c
from asyncrl.run.stats import RunStats


def expected_scalars(records: list[dict]) -> dict[str, list[tuple[int, float, float]]]:
    """A slow reference of the mapping: tag -> [(step, value, wall time)] in record order."""
    out: dict[str, list[tuple[int, float, float]]] = {}
    last_learner = 0
    for r in records:
        own = [r[k] for k in ("learner/version", "eval/version", "generator/version", "weights/version",
                              "checkpoint/version") if k in r]  # fmt: skip
        if "learner/version" in r:
            last_learner = r["learner/version"]
        step = own[0] if own else last_learner
        for k, v in r.items():
            if type(v) in (int, float) and k != "time" and not k.endswith("_at"):
                out.setdefault(k, []).append((step, v, r["time"]))
    return out


def read_back(logdir) -> dict[str, list[tuple[int, float, float]]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for tag, points in want.items():
        assert [(s, t) for s, _, t in got[tag]] == [(s, t) for s, _, t in points], tag  # steps and wall times
        assert [v for _, v, _ in got[tag]] == pytest.approx([v for _, v, _ in points], rel=1e-6), tag  # float32


class Stream:
    """The part of RunControl that RunStats.drain reads: the run's metrics stream, one learner step of
    records per drain (as the launcher polls)."""

    bad_metrics = 0

    def __init__(self, records: list[dict]):
        self.batches = [[]]
        for r in records:
            self.batches[-1].append(r)
            if "learner/version" in r:
                self.batches.append([])

    def read_metrics(self, cursor: str) -> tuple[str, list[dict]]:
        return cursor, self.batches.pop(0) if self.batches else []

    def trim_metrics(self, cursor: str) -> None:
        pass

    def staleness_histogram(self) -> dict[int, int]:
        return {0: 3, 1: 5}

    def first_metrics_id(self) -> str:
        return "0-0"


class Buffer:
    def __init__(self):
        self.queued = 0

    def stats(self) -> dict[str, int]:
        self.queued += 1
        return {"queued": self.queued, "pending": 2}


def launch_logs(run_dir, records: list[dict], resumed: bool = False) -> None:
    """What one launch's RunStats writes of ``records`` (the children's) and its own."""
    stats, stream, buffer = RunStats(RunConfig(), run_dir, resumed=resumed), Stream(records), Buffer()
    while stream.batches:
        stats.drain(stream, buffer=buffer)
    stats.write_summary(run_dir, "completed")


def test_crc32c_is_castagnoli():
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    assert crc32c(b"") == 0
    assert masked_crc32c(b"") == 0xA282EAD8  # TFRecord's mask of a zero CRC


def test_every_record_reads_back_as_in_metrics_jsonl(tmp_path):
    launch_logs(tmp_path, demo_records(launcher=False))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r for r in records if "source" in r] == [r for r in demo_records() if "source" in r]
    got = read_back(tmp_path / "tensorboard")
    assert_same(got, expected_scalars(records))
    assert "learner/tis_clipped" not in got and "time/step_end_at" not in got and "time" not in got
    assert [s for s, _, _ in got["eval/reward_mean"]] == [0, 8]
    assert [s for s, _, _ in got["weights/sync_seconds"]] == list(range(1, 8))  # the launcher computes them
    assert [s for s, _, _ in got["buffer/queued"]] == list(range(1, 9))  # no version of its own: the learner's
    assert got["fleet/generators"][0][:2] == (0, 2.0)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["staleness_histogram"] == {"0": 3, "1": 5}


def test_a_resumed_run_adds_a_file_and_keeps_the_old_one(tmp_path):
    records = demo_records(steps=8, launcher=False)
    half = len(records) // 2
    first, second = records[:half], [{"fleet/generators": 1, "time": records[half]["time"]}, *records[half:]]
    launch_logs(tmp_path, first)
    (old,) = (tmp_path / "tensorboard").iterdir()
    before = old.read_bytes()
    launch_logs(tmp_path, second, resumed=True)  # logs only the new records, at the old launch's version
    files = sorted((tmp_path / "tensorboard").iterdir())
    assert len(files) == 2 and old in files and old.read_bytes() == before
    got = read_back(tmp_path / "tensorboard")
    assert_same(got, expected_scalars(read_metrics(tmp_path / "metrics.jsonl")))
    assert [s for s, _, _ in got["learner/loss"]] == list(range(1, 9))
    last = max(r["learner/version"] for r in first if "learner/version" in r)
    assert [s for s, _, _ in got["fleet/generators"]] == [0, last]  # no version: where the first launch ended


def test_every_record_is_framed_and_checksummed(tmp_path):
    launch_logs(tmp_path, demo_records(steps=2))
    records = read_metrics(tmp_path / "metrics.jsonl")
    (path,) = (tmp_path / "tensorboard").iterdir()
    data, pos, n = path.read_bytes(), 0, 0
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked_crc32c(header)
        body = data[pos + 12 : pos + 12 + length]
        assert struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])[0] == masked_crc32c(body)
        pos, n = pos + 16 + length, n + 1
    assert pos == len(data) and n == 1 + len(records)  # file_version, then one per record
