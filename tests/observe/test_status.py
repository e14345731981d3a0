"""``asyncrl status`` against a real redis-server: the exact numbers of a buffer we filled by hand,
live and from the copied append-only file of a stopped server, and the error cases. A real demo launch
while it runs and after it ended: tests/e2e/test_e2e.py (the shared demo run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from demo_launch import ROOT

from asyncrl.buffers import run_prefix
from asyncrl.buffers.redis_buffer import RedisBuffer
from asyncrl.control import RunControl, connect
from asyncrl.errors import UserError
from asyncrl.fleet.redis_server import free_loopback_port
from asyncrl.observe.status import render, status

NOW_VERSION = 7


def fill(url: str, prefix: str) -> None:
    """A small run by hand; :data:`EXPECTED` are its numbers."""
    buf = RedisBuffer(url, prefix)
    control = RunControl(connect(url), prefix)
    try:
        for _ in range(8):
            assert buf.try_start_group(serving_version=10, max_policy_lag=1, groups_per_step=8) is not None
        for i in range(7):  # gen-0 pushes the even groups, gen-1 the odd ones
            assert buf.push(f"g{i}", f"frame-{i}".encode(), producer=f"gen-{i % 2}")
        assert not buf.push("g0", b"frame-0", producer="gen-0")  # duplicate
        buf.release(1)
        buf.record_replays(1)
        e0, e1, e2 = buf.read("rank0", 3, 0)
        e3, e4, e5 = buf.read("rank1", 3, 0)  # g6 stays queued
        assert buf.ack([e0], "trained") == 1
        assert buf.ack([e3], "stale") == 1
        assert buf.dead_letter(e1, "shape mismatch")
        assert buf.dead_letter(e4, "shape mismatch")
        assert buf.dead_letter(e5, "not finite")
        buf.set_version(NOW_VERSION)  # e2 stays pending on rank0
        control.heartbeat("generator", "0", version=6, pid=1111)
        control.heartbeat("generator", "1", version=5, pid=2222)
        control.r.delete(prefix + "hb:generator:1")  # as if its heartbeat expired
        control.heartbeat("learner", "0", version=NOW_VERSION, pid=3333)
        control.count_staleness([0, 0, 1])
        control.set_meta("weights_address", "tcp://127.0.0.1:5555")
    finally:
        buf.close()
        control.r.close()


EXPECTED_BUFFER = {
    "started": 8,
    "pushed": 7,
    "duplicates": 1,
    "abandoned": 1,
    "failed": 0,
    "trained": 1,
    "dropped_stale": 1,
    "filtered": 0,
    "dead": 3,
    "replayed": 1,
    "resumed": 0,
    "foreign": 0,
    "queued": 1,
    "pending": 1,
    "foreign_in_buffer": 0,
    "lost": 0,
    "unfinished": 0,  # 8 started - 7 pushed - 1 abandoned - 0 failed
    "orphans": 0,
    "live": 4,  # 8 started + 1 replayed - 1 abandoned - 1 stale - 3 dead
    "stream_length": 2,
}
EXPECTED_DEAD = {
    "total": 3,
    "kept": 3,
    "top_reasons": [
        {"reason": "shape mismatch", "count": 2, "producers": {"gen-1": 1, "gen-0": 1}},
        {"reason": "not finite", "count": 1, "producers": {"gen-1": 1}},
    ],
}


def check_numbers(st: dict, prefix: str, alive: bool) -> None:
    assert st["prefix"] == prefix and st["version"] == NOW_VERSION
    assert st["buffer"] == EXPECTED_BUFFER
    assert {k: v["pending"] for k, v in st["consumers"].items()} == {"rank0": 1, "rank1": 0}
    idle = [v["idle_ms"] for v in st["consumers"].values()]
    assert all(i >= 0 for i in idle) if st["source"] == "live" else idle == [None, None]
    assert st["dead_letters"] == EXPECTED_DEAD
    assert st["staleness"] == {"0": 2, "1": 1}
    gens = st["generators"]
    assert {i: (g["version"], g["lag"], g["pid"], g["alive"]) for i, g in gens.items()} == {
        "0": (6, 1, 1111, alive),
        "1": (5, 2, 2222, False),
    }
    assert all(0 <= g["age_s"] < 60 for g in gens.values())
    assert st["learners"]["0"]["lag"] == 0 and st["learners"]["0"]["alive"] == alive
    assert st["meta"] == {"weights_address": "tcp://127.0.0.1:5555"}


def write_run_dir(run_dir: Path, url: str, prefix: str, launcher_pid: int | None, redis_dir: Path | None) -> Path:
    run_dir.mkdir(parents=True)
    url_file = run_dir / "redis.url"
    fd = os.open(url_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(url + "\n")
    info = {
        "run_id": prefix[len("asyncrl:{") : -2],
        "prefix": prefix,
        "launcher_pid": launcher_pid,
        "redis_pid": None,
        "redis_address": url.rsplit("@", 1)[1].split("/")[0],
        "redis_url_file": str(url_file),
        "redis_dir": None if redis_dir is None else str(redis_dir),
        "pids": {},
    }
    (run_dir / "run.json").write_text(json.dumps(info, indent=2) + "\n")
    return run_dir


def cli(*args: str, timeout: float = 60, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "status", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli_json(*args: str) -> dict:
    out = cli(*args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def new_prefix() -> str:
    return run_prefix(f"t-{uuid.uuid4().hex[:8]}")


def snapshot(root: Path) -> dict[str, tuple[bytes, int, int]]:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mode, p.stat().st_mtime_ns) for p in root.rglob("*")
            if p.is_file()}  # fmt: skip


# ----- fast: a buffer filled by hand ------------------------------------------------------------


@pytest.mark.redis
def test_live_run_dir_reports_exact_numbers(redis_server, tmp_path):
    prefix = new_prefix()
    fill(redis_server.url, prefix)
    run_dir = write_run_dir(tmp_path / "run", redis_server.url, prefix, os.getpid(), None)
    st = status(run=run_dir)
    check_numbers(st, prefix, alive=True)
    assert st["state"] == "running" and st["source"] == "live"
    out = cli_json("--run", str(run_dir))
    check_numbers(out, prefix, alive=True)
    assert out["state"] == "running" and out["redis"] == f"127.0.0.1:{redis_server.port}"


@pytest.mark.redis
def test_table_output_names_everything_and_hides_the_password(redis_server, tmp_path):
    prefix = new_prefix()
    fill(redis_server.url, prefix)
    run_dir = write_run_dir(tmp_path / "run", redis_server.url, prefix, None, None)
    out = cli("--run", str(run_dir))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert redis_server.password not in text + out.stderr
    for word in ("ended", "version 7", "rank0", "rank1", "shape mismatch", "gen-0 (1)", "generator-1", "lost 0"):
        assert word in text, (word, text)


@pytest.mark.redis
def test_redis_url_finds_the_only_run_and_refuses_to_guess(make_redis_server):
    server = make_redis_server()
    prefix = new_prefix()
    fill(server.url, prefix)
    st = cli_json("--redis-url", server.url)
    check_numbers(st, prefix, alive=True)
    assert st["state"] == "running"  # no launcher pid: live heartbeats say so
    RunControl(connect(server.url), prefix).request_stop("done")
    assert cli_json("--redis-url", server.url, "--prefix", prefix)["state"] == "ended"
    other = new_prefix()
    RedisBuffer(server.url, other).close()  # a second run on the same server
    out = cli("--redis-url", server.url)
    assert out.returncode == 2 and "2 runs at" in out.stderr and prefix in out.stderr and other in out.stderr
    assert server.password not in out.stderr
    assert cli_json("--redis-url", server.url, "--prefix", other)["buffer"]["pushed"] == 0
    missing = new_prefix()
    out = cli("--redis-url", server.url, "--prefix", missing)
    assert out.returncode == 2 and f"no run with prefix {missing!r}" in out.stderr


@pytest.mark.redis
def test_redis_url_without_runs_is_an_error(make_redis_server):
    server = make_redis_server(appendonly=False)
    with pytest.raises(UserError, match="no asyncrl run found at 127.0.0.1:"):
        status(redis_url=server.url)


@pytest.mark.redis
def test_ended_run_reads_a_copy_of_its_append_only_file(make_redis_server, tmp_path):
    server = make_redis_server()
    prefix = new_prefix()
    fill(server.url, prefix)
    live = status(redis_url=server.url, prefix=prefix)
    server.stop()  # as the launcher does at the end of a run (SIGTERM: the AOF is flushed)
    run_dir = write_run_dir(tmp_path / "run", server.url, prefix, None, server.workdir)
    before = snapshot(run_dir), snapshot(server.workdir)
    st = cli_json("--run", str(run_dir))
    assert st["source"] == "aof-copy" and st["state"] == "ended" and st["redis"] == f"127.0.0.1:{server.port}"
    check_numbers(st, prefix, alive=False)
    for key in ("version", "buffer", "dead_letters", "staleness", "meta"):
        assert st[key] == live[key], key
    assert (snapshot(run_dir), snapshot(server.workdir)) == before  # nothing in the run changed
    assert not server.is_running()


def test_missing_run_json_is_a_one_line_error(tmp_path):
    with pytest.raises(UserError, match=r"no run at .*: run.json not found"):
        status(run=tmp_path / "nope")
    out = cli("--run", str(tmp_path / "nope"))
    assert out.returncode == 2 and out.stderr.startswith("asyncrl: error: no run at ")
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.redis
@pytest.mark.parametrize(
    "args",
    [("demo",), ("runs/demo",), ("--run", "demo"), ("--run", "runs/demo"), ("{abs}",), ("--run", "{abs}")],
    ids=["name", "path", "--run name", "--run path", "absolute", "--run absolute"],
)
def test_a_run_is_named_as_launch_names_it_or_by_its_directory(redis_server, tmp_path, args):
    """``asyncrl status demo`` reads runs/demo, as ``asyncrl launch --name demo`` wrote it; a path works too."""
    prefix = new_prefix()
    fill(redis_server.url, prefix)
    run_dir = write_run_dir(tmp_path / "runs" / "demo", redis_server.url, prefix, os.getpid(), None)
    out = cli(*(a.format(abs=run_dir) for a in args), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    check_numbers(json.loads(out.stdout), prefix, alive=True)


def test_a_run_name_that_is_nowhere_names_both_places_in_one_line(tmp_path):
    for args in [("nope",), ("--run", "nope")]:
        out = cli(*args, cwd=tmp_path)
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip() == "asyncrl: error: no run named nope: neither nope nor runs/nope holds a run.json"


def test_status_takes_one_run(tmp_path):
    for args in [(), ("a", "--run", "b"), ("a", "--redis-url", "redis://127.0.0.1:1/0")]:
        out = cli(*args, cwd=tmp_path)
        assert out.returncode == 2 and "asyncrl status takes one run" in out.stderr, (args, out.stderr)


def test_unreachable_server_without_a_data_dir_is_an_error(tmp_path):
    password = "s3cret-" + uuid.uuid4().hex
    url = f"redis://:{password}@127.0.0.1:{free_loopback_port()}/0"
    run_dir = write_run_dir(tmp_path / "run", url, new_prefix(), None, None)
    out = cli("--run", str(run_dir))
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("asyncrl: error: cannot reach Redis at 127.0.0.1:")
    assert "no Redis data directory" in out.stderr and password not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.redis
def test_render_is_plain_rich(redis_server, tmp_path):
    from rich.console import Console

    prefix = new_prefix()
    fill(redis_server.url, prefix)
    console = Console(record=True, width=100)
    render(status(redis_url=redis_server.url, prefix=prefix), console)
    text = console.export_text()
    assert "dead letters: 3" in text and "0 behind: 2" in text
