"""``asyncrl launch --backend ray`` on a cluster too small for the run fails at once with one line naming
the shortfall (it used to place the learners, leave the generators pending and wait in silence), and
SIGTERM of a Ray-backend launcher is a clean stop with exit 143 (it used to print Ray's stack dump and
exit 1).

The cluster is the test's own: one head, ``ray start --head --block --num-cpus 2`` as the README starts
it, in its own session, on free ports, ended by that session at teardown (never ``ray stop``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from demo_launch import ROOT, demo_launch_cmd
from services import in_ci
from test_ray import _end_session, _free_port

from asyncrl.run import ray_backend

RAY = Path(sys.executable).with_name("ray")
CLUSTER_START_S = 120  # a GCS and a raylet on 2 busy cores start in ~10 s; generous for a loaded CI box
LAUNCH_TIMEOUT_S = 600  # a bound on a broken launcher; a working one answers in seconds


# -- the rule, no Ray ----------------------------------------------------------------------------------
def test_what_a_run_needs_and_what_a_cluster_lacks():
    needs = ray_backend.run_needs
    assert needs(2, 2, {"CPU": 2}) == {"CPU": 4}
    assert needs(2, 3, {"CPU": 8, "generator": 4}) == {"CPU": 2, "generator": 3}
    assert needs(1, 2, {"CPU": 8, "GPU": 4}) == {"CPU": 3, "GPU": 3}
    assert needs(1, 0, {"CPU": 1}) == {"CPU": 1}
    short = ray_backend.shortfall
    assert short({"CPU": 4}, {"CPU": 2.0}, {"CPU": 2.0}) == "4 CPU (free 2 of 2)"
    assert short({"CPU": 2, "generator": 3}, {"CPU": 8, "generator": 1}, {"CPU": 8, "generator": 4}) == (
        "3 generator (free 1 of 4)"
    )
    assert short({"CPU": 2, "GPU": 1}, {"CPU": 2}, {"CPU": 2}) == "1 GPU (free 0 of 0)"
    assert short({"CPU": 2}, {"CPU": 2.0}, {"CPU": 4.0}) is None


# -- a real head ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_head() -> Iterator[str]:
    """A one-node cluster of 2 CPUs, as the README's `ray start --head --num-cpus 2`; yields its address."""
    if importlib.util.find_spec("ray") is None or not RAY.exists():
        if in_ci():
            pytest.fail("Ray is not installed (pip install -e '.[ray]'); CI=true, so this is a failure")
        pytest.skip("Ray is not installed (pip install -e '.[ray]')")
    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-rayres-", dir="/tmp"))  # short: unix socket paths
    port = _free_port()
    address = f"127.0.0.1:{port}"
    ports = ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port"]
    ports += ["--runtime-env-agent-port", "--node-manager-port", "--object-manager-port"]
    ports += ["--ray-client-server-port", "--dashboard-port"]
    args = ["--head", "--port", str(port), "--temp-dir", str(tmp / "ray"), "--include-dashboard", "false"]
    args += ["--node-ip-address", "127.0.0.1", *[x for flag in ports for x in (flag, str(_free_port()))]]
    log = tmp / "head.log"
    with log.open("w") as out:
        head = subprocess.Popen(
            [str(RAY), "start", "--block", "--disable-usage-stats", "--num-cpus", "2", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        )
    try:
        deadline = time.monotonic() + CLUSTER_START_S
        while True:
            assert head.poll() is None, f"ray start exited: {log.read_text()[-2000:]}"
            status = subprocess.run([str(RAY), "status", "--address", address], capture_output=True, text=True)
            if status.returncode == 0 and "Active" in status.stdout:
                break
            assert time.monotonic() < deadline, f"the head did not come up: {status.stdout[-1000:]}"
            time.sleep(1)
        yield address
    finally:
        _end_session(head)  # `ray start --block` stops its node on SIGTERM; SIGKILL for what is left
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.redis
def test_a_cluster_too_small_for_the_run_is_one_line_at_once(small_head, tmp_path):
    cmd = demo_launch_cmd(tmp_path, "too-big", "--generators", "2", "--learners", "2")
    cmd += ["--backend", "ray", "--address", small_head]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("asyncrl: error: ")]
    assert len(errors) == 1 and out.stderr.rstrip().endswith(errors[0]), out.stderr[-3000:]  # the launcher's log above
    for needle in ("too little room for 2 learner ranks and 2 generators", "they need 4 CPU (free 2 of 2)"):
        assert needle in errors[0], errors[0]
    assert "Traceback" not in out.stderr and "placed" not in out.stdout + out.stderr  # nothing was placed
    assert json.loads((tmp_path / "too-big" / "summary.json").read_text())["exit_reason"] == "failed"


@pytest.mark.slow
@pytest.mark.redis
def test_sigterm_of_a_ray_launcher_is_a_clean_stop_with_143(small_head, tmp_path):
    cmd = demo_launch_cmd(tmp_path, "fits", "--generators", "1", "--learners", "1", "--steps", "10000")
    cmd += ["--set", "run.eval_every=0", "--backend", "ray", "--address", small_head]
    out_path = tmp_path / "launch.out"
    with out_path.open("w") as out:
        env = {**os.environ, "COLUMNS": "250"}
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while "actors placed and started" not in out_path.read_text(errors="replace"):
            assert proc.poll() is None, f"the launcher exited ({proc.returncode}):\n{out_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no actors placed:\n{out_path.read_text()[-4000:]}"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    text = out_path.read_text(errors="replace")
    assert code == 143, text[-4000:]
    for dump in ("Traceback", "SIGTERM received", "*** ", "Stack trace"):
        assert dump not in text, (dump, text[-4000:])
    reason = json.loads((tmp_path / "fits" / "summary.json").read_text())["exit_reason"]
    assert reason in ("terminated", "interrupted"), reason  # the launcher's orderly stop, summary written
