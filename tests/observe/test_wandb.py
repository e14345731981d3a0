"""run.wandb: offline logs every record to a real W&B offline run (read back from its .wandb file);
asked for without wandb installed, one clear error before the launch starts anything."""

from __future__ import annotations

import importlib.util
import json
import struct

import pytest
from metrics_fixtures import demo_records

from asyncrl.config import load_config
from asyncrl.errors import UserError
from asyncrl.observe.metrics import check_wandb, open_sinks, read_metrics


def read_wandb_history(path) -> list[dict]:
    """The history rows of a .wandb file: a LevelDB-style log (7-byte file header, then 32 KiB blocks
    of chunks: crc32c, uint16 length, type 1 full / 2 first / 3 middle / 4 last) of Record protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending, rows = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item  # a key with a '/' is stored split, as nested_key
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


def test_offline_run_holds_every_record_at_its_version(tmp_path):
    run = load_config(None, {"run.wandb": "offline", "run.name": "wb"}).run
    sinks = open_sinks(run, tmp_path)
    for r in demo_records(steps=4):
        sinks.log(r)
    assert [type(sink).__name__ for sink in sinks.extras] == ["TensorBoardSink", "WandbSink"]  # none dropped
    sinks.close()  # the .wandb file whole on return: read at once, not waited for
    (path,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in read_wandb_history(path)]
    want, version = [], 0
    for r in read_metrics(tmp_path / "metrics.jsonl"):
        own = [r[k] for k in ("learner/version", "eval/version", "generator/version", "weights/version",
                              "checkpoint/version") if k in r]  # fmt: skip
        version = r["learner/version"] if "learner/version" in r else version
        values = {k: v for k, v in r.items() if type(v) in (int, float) and k != "time" and not k.endswith("_at")}
        want.append({**values, "version": own[0] if own else version})
    assert rows == want  # JSON round trip: floats as written
    assert {"eval/reward_mean": pytest.approx(0.52), "eval/version": 4, "version": 4} in [
        {k: row[k] for k in ("eval/reward_mean", "eval/version", "version")} for row in rows if "eval/version" in row
    ]


def test_asking_for_wandb_without_it_is_one_clear_error(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(UserError, match=r"pip install 'asyncrl\[wandb\]'"):
        check_wandb("offline")
    check_wandb("off")  # not asked for: nothing to check
