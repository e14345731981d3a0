"""``asyncrl status``'s text view shows every counter its JSON view has (foreign entries and the dead
letters kept included) and leaves the weight-sync probe's log-prob arrays to ``--json``.

One run's buffer is written by hand against a real redis-server: groups pushed and dead-lettered, and
11 foreign entries (raw stream writes, as a hostile or confused client makes) that the consumer
dead-letters unread. A pure test renders a hand-made snapshot.
"""

from __future__ import annotations

import json
import re
import uuid

import pytest
from rich.console import Console

from asyncrl.buffers import run_prefix
from asyncrl.buffers.redis_buffer import RedisBuffer
from asyncrl.control import RunControl, connect
from asyncrl.observe import probe
from asyncrl.observe.status import render, status

FOREIGN = 11


def text_of(snapshot: dict) -> str:
    console = Console(record=True, width=200)
    render(snapshot, console)
    return console.export_text()


def assert_every_counter_shown(snapshot: dict, text: str) -> None:
    flat = re.sub(r"\s+", " ", text)
    for key, value in snapshot["buffer"].items():
        assert f"{key} {value}" in flat, (key, value, text)
    dead = snapshot["dead_letters"]
    assert f"dead letters: {dead['total']}" in flat and f"kept {dead['kept']}" in flat, text


def fill_with_foreign(url: str, prefix: str) -> None:
    buf = RedisBuffer(url, prefix)
    control = RunControl(connect(url), prefix)
    try:
        for i in range(3):
            assert buf.try_start_group(serving_version=0, max_policy_lag=1, groups_per_step=4) is not None
            assert buf.push(f"g{i}", f"frame-{i}".encode(), producer="gen-0")
        for i in range(FOREIGN):  # never admitted nor pushed: foreign
            control.r.xadd(buf.keys.traj, {"gid": f"raw{i}", "producer": "intruder", "frame": b"\x00"})
        entries = buf.read("rank0", 3 + FOREIGN, 0)
        assert len(entries) == 3 + FOREIGN
        for entry in entries:
            verdict = buf.dead_letter(entry, "not a group" if not entry.admitted else "shape mismatch")
            assert verdict == ("dead" if entry.admitted else "foreign")
        buf.set_version(4)
        for version in range(1, 9):  # what a learner leaves in the run's metadata
            probe.publish(control, version, [-1.2345678] * 64)
        control.set_meta("weights_address", "tcp://127.0.0.1:5555")
    finally:
        buf.close()
        control.r.close()


@pytest.mark.redis
def test_text_shows_foreign_entries_and_the_dead_letters_kept(redis_server):
    prefix = run_prefix(f"text-{uuid.uuid4().hex[:8]}")
    fill_with_foreign(redis_server.url, prefix)
    st = status(redis_url=redis_server.url, prefix=prefix)
    assert st["buffer"]["foreign"] == FOREIGN and st["buffer"]["dead"] == 3
    assert st["dead_letters"]["kept"] == FOREIGN + 3
    assert any(k.startswith("probe:") for k in st["meta"])  # --json keeps them
    text = text_of(st)
    assert_every_counter_shown(st, text)
    assert "not a group" in text and "intruder (11)" in text  # the foreign ones' reason and producer


@pytest.mark.redis
def test_text_hides_the_probe_arrays(redis_server):
    prefix = run_prefix(f"text-{uuid.uuid4().hex[:8]}")
    fill_with_foreign(redis_server.url, prefix)
    st = status(redis_url=redis_server.url, prefix=prefix)
    text = text_of(st)
    assert "probe:" not in text and "-1.2345678" not in text
    assert "weights_address=tcp://127.0.0.1:5555" in text
    assert len(text.splitlines()) < 60, text  # a screen, not 100 lines of arrays


def test_every_counter_of_a_hand_made_snapshot_is_in_the_text():
    buffer = {
        "started": 20, "pushed": 18, "duplicates": 1, "abandoned": 2, "failed": 0, "trained": 9,
        "dropped_stale": 3, "filtered": 4, "dead": 0, "replayed": 5, "resumed": 6, "foreign": 11, "queued": 1,
        "pending": 1, "foreign_in_buffer": 0, "lost": 0, "unfinished": 0, "orphans": 13, "live": 7, "stream_length": 2,
    }  # fmt: skip
    snapshot = {
        "run_id": "r-1", "prefix": "asyncrl:{r-1}:", "redis": "127.0.0.1:1", "source": "live", "state": "running",
        "version": 4, "meta": {"probe:4": json.dumps([-0.5] * 64), "weights_address": "tcp://x:1"},
        "fleet": [], "buffer": buffer, "consumers": {}, "staleness": {},
        "dead_letters": {"total": 0, "kept": 11, "top_reasons": [
            {"reason": "no frame", "count": 11, "producers": {"intruder": 11}}]},
        "generators": {}, "learners": {},
    }  # fmt: skip
    text = text_of(snapshot)
    assert_every_counter_shown(snapshot, text)
    assert "probe:" not in text and "no frame" in text
