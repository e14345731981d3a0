"""``asyncrl launch --backend ray`` against a real two-node Ray cluster on this machine.

The cluster is the test's own: a head (``ray start --head --block``, a private temp dir, free ports) and a
second node offering the ``generator`` resource, each in its own session. Teardown ends them by session
id (worker node first, then the head; SIGTERM, then SIGKILL of whatever of those sessions is left),
never with ``ray stop``, which would end every Ray process on the machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from demo_launch import ROOT, demo_launch_cmd
from services import in_ci

from asyncrl.run.ray_backend import (
    ACTOR_LOST,
    EXIT_MARK,
    exit_code_in_log,
    generator_options,
    learner_bundle,
    rendezvous_env,
)
from asyncrl.rundir import pid_alive

RAY = Path(sys.executable).with_name("ray")
CLUSTER_START_S = 120  # two raylets and a GCS on 2 busy cores start in ~10 s; generous for a loaded CI box


# -- placement rules, no Ray -------------------------------------------------------------------------
def test_generators_take_the_generator_resource_when_the_cluster_has_it():
    assert generator_options({"CPU": 4, "generator": 4}) == {"resources": {"generator": 1}, "num_cpus": 0}
    assert generator_options({"CPU": 4}) == {"num_cpus": 1}
    assert generator_options({"CPU": 4, "GPU": 2}) == {"num_cpus": 1, "num_gpus": 1}
    on_gpus = {"resources": {"generator": 1}, "num_cpus": 0, "num_gpus": 1}
    assert generator_options({"GPU": 2, "generator": 2}) == on_gpus
    assert learner_bundle({"CPU": 4}) == {"CPU": 1} and learner_bundle({"GPU": 8}) == {"CPU": 1, "GPU": 1}


def test_rendezvous_is_loopback_on_one_node_and_rank_0s_node_across_nodes():
    one = rendezvous_env(["10.0.0.5", "10.0.0.5"], 2345)
    assert [e["MASTER_ADDR"] for e in one] == ["127.0.0.1"] * 2 and one[1]["GLOO_SOCKET_IFNAME"]
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in one] == [("0", "0", "2"), ("1", "1", "2")]
    two = rendezvous_env(["10.0.0.7", "10.0.0.5", "10.0.0.7"], 2345)
    assert {e["MASTER_ADDR"] for e in two} == {"10.0.0.7"} and {e["MASTER_PORT"] for e in two} == {"2345"}
    assert [e["LOCAL_RANK"] for e in two] == ["0", "0", "1"] and all("GLOO_SOCKET_IFNAME" not in e for e in two)
    assert {e["WORLD_SIZE"] for e in two} == {"3"}


def test_the_exit_code_an_actor_left_in_its_log(tmp_path):
    log = tmp_path / "generator-0.log"
    assert exit_code_in_log(log) == ACTOR_LOST  # no log at all
    log.write_text(f"engine failed\n{EXIT_MARK}-9; ending the actor so Ray replaces it\nlater output\n")
    assert exit_code_in_log(log) == -9
    log.write_text("killed with its actor: no mark\n")
    assert exit_code_in_log(log) == ACTOR_LOST


@pytest.mark.slow  # the launch checks the demo model first (built once, about a minute, if missing)
@pytest.mark.redis
def test_a_launch_without_a_cluster_fails_at_once_and_says_why(tmp_path):
    cmd = demo_launch_cmd(tmp_path, "no-ray", "--address", "127.0.0.1:1")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--address names a Ray cluster" in out.stderr, out.stderr[-2000:]
    cmd = demo_launch_cmd(tmp_path, "no-ray", "--backend", "ray", "--address", f"127.0.0.1:{_free_port()}")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no Ray cluster answers at 127.0.0.1:" in out.stderr, out.stderr[-2000:]
    assert json.loads((tmp_path / "no-ray" / "summary.json").read_text())["exit_reason"] == "failed"


# -- a real cluster ----------------------------------------------------------------------------------
def require_ray() -> None:
    """Ray missing skips on a laptop but fails under CI (scripts/setup.sh installs it)."""
    if importlib.util.find_spec("ray") is None or not RAY.exists():
        msg = "Ray is not installed (pip install -e '.[ray]')"
        if in_ci():
            pytest.fail(msg + "; CI=true, so this is a failure, not a skip")
        pytest.skip(msg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session(leader: int) -> list[int]:
    """Pids of the processes in ``leader``'s session (what one ``ray start`` started)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == leader:
                    out.append(int(entry))
            except OSError:
                pass
    return out


def _end_session(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the ``ray start --block`` leader (it stops its node), then SIGKILL what is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    for pid in _session(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=10)


def _ray_start(args: list[str], log: Path) -> subprocess.Popen:
    ports = ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port"]
    ports += ["--runtime-env-agent-port", "--node-manager-port", "--object-manager-port"]
    fixed = [x for flag in ports for x in (flag, str(_free_port()))]  # their defaults are fixed numbers
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with log.open("w") as out:
        return subprocess.Popen(
            [str(RAY), "start", "--block", "--disable-usage-stats", "--num-cpus", "2", *fixed, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )


def _wait_status(address: str, needle: str, nodes: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + CLUSTER_START_S
    while True:
        for node, log in zip(nodes, logs, strict=True):
            assert node.poll() is None, f"ray start exited: {log.read_text()[-2000:]}"
        out = subprocess.run([str(RAY), "status", "--address", address], capture_output=True, text=True)
        if out.returncode == 0 and needle in out.stdout:
            return
        assert time.monotonic() < deadline, f"no {needle!r} in the cluster's status: {out.stdout[-1000:]}"
        time.sleep(1)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[dict]:
    """A head node (2 CPUs) and a node with 2 CPUs and 4 ``generator``; {address, start_s}."""
    require_ray()
    # short: Ray's unix sockets live under the temp dir and a socket path has at most 107 bytes
    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-ray-", dir="/tmp"))
    port = _free_port()
    address = f"127.0.0.1:{port}"
    started = time.monotonic()
    head_args = ["--head", "--port", str(port), "--temp-dir", str(tmp / "ray"), "--include-dashboard", "false"]
    head_args += ["--node-ip-address", "127.0.0.1", "--ray-client-server-port", str(_free_port())]
    head_args += ["--dashboard-port", str(_free_port())]
    nodes, logs = [], [tmp / "head.log", tmp / "node.log"]
    try:
        nodes.append(_ray_start(head_args, logs[0]))
        _wait_status(address, "Active", nodes, logs[:1])
        node_args = ["--address", address, "--node-ip-address", "127.0.0.1", "--resources", '{"generator": 4}']
        nodes.append(_ray_start(node_args, logs[1]))
        _wait_status(address, "generator", nodes, logs)
        yield {"address": address, "start_s": time.monotonic() - started, "sessions": [n.pid for n in nodes]}
    finally:
        for node in reversed(nodes):  # the worker node first: it drains through the head's GCS
            _end_session(node)
        shutil.rmtree(tmp, ignore_errors=True)
    assert not [pid for n in nodes for pid in _session(n.pid)], "Ray processes left after teardown"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet, or being rewritten
        return {}


def _latest_version(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max((m.get("learner/version", 0) for m in lines), default=0)


def _wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"the launcher exited ({proc.returncode}) waiting for {what}:\n{_tail(proc)}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{_tail(proc)}"
        time.sleep(0.5)


def _launch(cmd: list[str], out: Path) -> subprocess.Popen:
    """The launcher, its output to ``out`` (read back with :func:`_tail`, also while it runs)."""
    with out.open("w") as f:
        env = {**os.environ, "COLUMNS": "250"}  # rich wraps log lines at the width, 80 without a terminal
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    proc.out_path = out
    return proc


def _tail(proc: subprocess.Popen, chars: int = 4000) -> str:
    return proc.out_path.read_text(errors="replace")[-chars:]


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.vllm
def test_ray_launch_learns_and_ray_restarts_a_killed_generator(ray_cluster, tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    run_dir = tmp_path / "ray-demo"
    cmd = demo_launch_cmd(tmp_path, "ray-demo", "--generators", "2", "--learners", "2")
    cmd += ["--backend", "ray", "--address", ray_cluster["address"]]
    started = time.monotonic()
    proc = _launch(cmd, tmp_path / "launch.out")
    pids: set[int] = set()
    try:
        _wait_for(lambda: _latest_version(run_dir) >= 3, 600, "version 3", proc)
        info = _read_json(run_dir / "run.json")
        pids.update(info["pids"].values())
        victim, actor = info["pids"]["generator-0"], info["ray"]["actors"]["generator-0"]
        os.kill(victim, signal.SIGKILL)  # the engine's process, as an engine crash would end it

        def replaced() -> bool:
            now = _read_json(run_dir / "run.json")
            return bool(now) and now["ray"]["actors"]["generator-0"] != actor

        _wait_for(replaced, 300, "Ray's new generator-0 actor", proc)
        after = _read_json(run_dir / "run.json")
        assert after["pids"]["generator-0"] != victim
        pids.update(after["pids"].values())
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the launcher's own stop: it kills every actor it made
            proc.wait(timeout=120)
    out = _tail(proc, 100_000)
    elapsed = time.monotonic() - started
    print(f"ray cluster start {ray_cluster['start_s']:.1f}s; ray launch end to end {elapsed:.1f}s")
    assert proc.returncode == 0, out[-4000:]
    assert "generator-0 exited with code -9; restarting (1)" in out, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["final_version"] == 40
    assert summary["final_eval_reward"] > summary["initial_eval_reward"] + 0.2, summary
    assert summary["buffer"]["lost"] == 0 and summary["restarts"]["generators"] == 1, summary
    assert EXIT_MARK in (run_dir / "logs" / "generator-0.log").read_text()
    deadline = time.monotonic() + 30  # SIGKILLed with their actors: gone once the kernel reaped them
    while [p for p in pids if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if pid_alive(p)], "worker processes outlived their actors"


# A Ray driver of its own for what only a driver can do: kill an actor, list the live ones.
DRIVER = """
import json, sys, ray
ray.init(address=sys.argv[1], namespace="asyncrl", log_to_driver=False, logging_level="ERROR")
if sys.argv[2] == "kill":
    ray.kill(ray.get_actor(sys.argv[3]), no_restart=False)
else:
    named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(sys.argv[3])]
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    print(json.dumps({"actors": named, "groups": len(groups)}))
"""


def _driver(address: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", DRIVER, address, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.vllm
def test_ray_restarts_a_killed_actor_and_a_dead_learner_and_ctrl_c_ends_every_actor(ray_cluster, tmp_path):
    pytest.importorskip("vllm")
    run_dir, address = tmp_path / "ray-stop", ray_cluster["address"]
    cmd = demo_launch_cmd(tmp_path, "ray-stop", "--generators", "2", "--learners", "1", "--steps", "10000")
    cmd += ["--set", "run.eval_every=0", "--set", "learner.max_restarts=1", "--backend", "ray", "--address", address]
    proc = _launch(cmd, tmp_path / "launch.out")
    try:
        _wait_for(lambda: _latest_version(run_dir) >= 2, 600, "version 2", proc)
        info = _read_json(run_dir / "run.json")
        pids = set(info["pids"].values())
        actor = info["ray"]["actors"]["generator-1"]
        _driver(address, "kill", f"{info['run_id']}/generator-1")  # Ray restarts it (no_restart=False)
        _wait_for(
            lambda: (
                _read_json(run_dir / "run.json").get("ray", {}).get("actors", {}).get("generator-1", actor) != actor
            ),
            300,
            "Ray's new generator-1 actor",
            proc,
        )
        info = _read_json(run_dir / "run.json")
        pids.update(info["pids"].values())
        reached = _latest_version(run_dir)
        _wait_for(lambda: _latest_version(run_dir) >= reached + 2, 300, "progress after the restart", proc)
        # a dead learner rank: every actor is replaced, the rank restarts from the committed checkpoint
        learner = info["pids"]["learner-0"]
        os.kill(learner, signal.SIGKILL)
        _wait_for(
            lambda: _read_json(run_dir / "run.json").get("pids", {}).get("learner-0", learner) != learner,
            300,
            "the learner's restart",
            proc,
        )
        pids.update(_read_json(run_dir / "run.json")["pids"].values())
        reached = _latest_version(run_dir)
        _wait_for(lambda: _latest_version(run_dir) >= reached + 2, 300, "progress after the learner's restart", proc)
        running = json.loads(_driver(address, "alive", info["run_id"]))
        assert len(running["actors"]) == 3 and running["groups"] == 1, running  # what Ctrl-C must end
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()  # the driver's end ends its actors too (they are not detached)
            proc.wait(timeout=60)
    out = _tail(proc, 100_000)
    assert proc.returncode == 130, out[-4000:]
    assert "generator-1 exited with code -1; restarting (1)" in out, out[-4000:]
    assert "learner-0 exited with code -9; restarting every learner rank" in out, out[-4000:]
    assert "Traceback" not in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "interrupted" and summary["final_version"] >= reached + 2
    assert summary["buffer"]["lost"] == 0, summary
    assert summary["restarts"] == {"generators": 1, "learners": 1, "redis": 0}, summary
    left = json.loads(_driver(address, "alive", info["run_id"]))
    assert left == {"actors": [], "groups": 0}, left
    deadline = time.monotonic() + 30
    while [p for p in pids if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if pid_alive(p)], "worker processes outlived their actors"
