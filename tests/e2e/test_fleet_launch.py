"""An elastic fleet on a live demo run: generators join from their own commands (one from another
network namespace, over TCP only), one leaves by SIGTERM, one is SIGKILLed, and the run goes on.

Learner rank 1 is paused (SIGSTOP) while the fleet changes, which holds rank 0 in its next
collective, so the run cannot end before a change has happened, however fast or slow this machine
is, while rank 0's weight publisher (a thread) still serves joiners; every wait is on an observed
state.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from demo_launch import ROOT, demo_launch_cmd
from netns import namespace

from asyncrl.buffers.redis_buffer import RedisBuffer
from asyncrl.control import RunControl, connect
from asyncrl.fleet.rendezvous import redis_url
from asyncrl.observe.status import open_run
from asyncrl.secret import new_secret, redis_password

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]


def wait_for(what: str, predicate, procs: list[subprocess.Popen], timeout_s: float = 240.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        for p in procs:
            assert p.poll() is None, f"{p.args[-6:]} exited with {p.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def status(run_dir: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "status", "--run", str(run_dir), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def pause(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        os.kill(pid, sig)


def test_generators_join_leave_and_die_while_the_run_goes_on(tmp_path):
    pytest.importorskip("vllm")
    secret = new_secret()
    env = {**os.environ, "ASYNCRL_SECRET": secret, "PYTHONUNBUFFERED": "1"}
    run_dir = tmp_path / "fleet"
    procs: list[subprocess.Popen] = []
    probe: subprocess.Popen | None = None  # tests/intruder.py
    with namespace("fleet") as ns:
        log = (tmp_path / "launch.log").open("w")
        args = ["--learners", "2", "--generators", "1", "--host", ns.outer, "--steps", "24"]
        launcher = subprocess.Popen(demo_launch_cmd(tmp_path, "fleet", *args), cwd=ROOT, env=env, stderr=log)
        procs.append(launcher)
        try:
            wait_for("the run", lambda: (run_dir / "run.json").is_file(), procs)
            run_info = json.loads((run_dir / "run.json").read_text())
            address = run_info["redis_address"]
            assert address.startswith(ns.outer + ":")  # advertised on the host's outward address
            url = redis_url(address, secret)
            control = RunControl(connect(url), run_info["prefix"])
            buffer = RedisBuffer(url, run_info["prefix"])
            wait_for("the first step", lambda: buffer.get_version() >= 1, procs)
            learners = [run_info["pids"]["learner-1"]]
            fleets = [status(run_dir)["fleet"]]

            pause(learners, signal.SIGSTOP)  # the run holds still while three generators join
            # from "another host", without the secret: no trajectories, no weights either way (the probe's
            # attempts run while the joiners start, and are read once they have joined)
            weights_address = control.get_meta("weights_address")
            assert weights_address.startswith(f"tcp://{ns.outer}:")
            probe_cmd = ns.cmd(sys.executable, "tests/intruder.py", address, run_info["prefix"], weights_address)
            probe = subprocess.Popen(probe_cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            joiners = {}
            for i, name in enumerate(("joined-a", "joined-b", "joined-ns")):
                cmd = [sys.executable, "-m", "asyncrl.cli", "generator", "--redis", address, "--id", name]
                cmd = ns.cmd(*cmd) if name == "joined-ns" else cmd
                with (tmp_path / f"{name}.log").open("w") as out:
                    joiners[name] = subprocess.Popen(
                        cmd, cwd=ROOT, env={**env, "VLLM_CPU_OMP_THREADS_BIND": str(i % 2)}, stdout=out, stderr=out
                    )
            procs += joiners.values()
            wait_for("four generators", lambda: len(control.members("generator")) == 4, procs)
            fleets.append(status(run_dir)["fleet"])

            def all_serve_the_newest() -> bool:  # a joiner gets the newest weights at once
                beats = control.heartbeats("generator")
                return len(beats) == 4 and all(int(b["version"]) >= buffer.get_version() for b in beats.values())

            wait_for("every generator on the newest weights", all_serve_the_newest, procs)
            probe_out, probe_err = probe.communicate(timeout=120)
            assert probe.returncode == 0, probe_err[-2000:]
            attempts = json.loads(probe_out.splitlines()[-1])
            assert len(attempts) == 8 and "accepted" not in attempts.values(), attempts
            assert attempts["weights without the secret"] is None and attempts["weights with a wrong secret"] is None
            listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=30).stdout
            assert secret not in listing and redis_password(secret) not in listing
            pause(learners, signal.SIGCONT)
            start = buffer.get_version()
            wait_for("three more steps", lambda: buffer.get_version() >= start + 3, procs)

            pause(learners, signal.SIGSTOP)  # and again while one leaves and one dies
            joiners["joined-a"].send_signal(signal.SIGTERM)
            assert joiners["joined-a"].wait(timeout=60) == 0  # a clean leave
            procs.remove(joiners["joined-a"])
            wait_for("joined-a out", lambda: "joined-a" not in control.members("generator"), procs)
            fleets.append(status(run_dir)["fleet"])
            joiners["joined-b"].kill()
            joiners["joined-b"].wait(timeout=30)
            procs.remove(joiners["joined-b"])
            wait_for("joined-b reaped", lambda: len(control.members("generator")) == 2, procs)
            fleets.append(status(run_dir)["fleet"])
            pause(learners, signal.SIGCONT)

            assert launcher.wait(timeout=600) == 0, (tmp_path / "launch.log").read_text()[-3000:]
            assert joiners["joined-ns"].wait(timeout=60) == 0  # the run's end ends a joined generator too
        finally:
            for p in procs + ([probe] if probe is not None else []):
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
            log.close()

    assert fleets == [
        ["0"],
        ["0", "joined-a", "joined-b", "joined-ns"],
        ["0", "joined-b", "joined-ns"],
        ["0", "joined-ns"],
    ]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["final_version"] == 24
    assert summary["final_eval_reward"] > summary["initial_eval_reward"] + 0.2, summary  # the demo's bar
    assert summary["buffer"]["lost"] == 0 and summary["restarts"]["generators"] == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pushed = {  # reported, not asserted per generator: how the slots spread is the scheduler's business
        name: sum(m.get("generator/groups", 0) for m in metrics if m.get("source") == f"generator/{name}")
        for name in ("0", "joined-a", "joined-b", "joined-ns")
    }
    sizes = [m["fleet/generators"] for m in metrics if "fleet/generators" in m]  # the joiners came one by one
    assert sizes[0] == 1 and max(sizes) == 4 and sizes[-3:] == [4, 3, 2], sizes
    # the launcher's log showed each change; admission never passed its limit through any of them
    text = (tmp_path / "launch.log").read_text()
    assert "generators: 4 live" in text and "joined-a left" in text and "joined-b stopped renewing" in text
    for path in [
        *tmp_path.glob("*.log"),
        *(p for p in run_dir.rglob("*") if p.suffix in (".log", ".json", ".jsonl", ".yaml")),
    ]:
        text = path.read_text(errors="replace")
        assert secret not in text and redis_password(secret) not in text, f"a secret in {path}"
    with open_run(run_dir) as source:
        records = RedisBuffer(source.url, source.prefix).admissions()
    assert records and all(live <= limit for _, live, limit in records)
    assert [seq for seq, _, _ in records] == list(range(len(records)))
    print(  # the figures of the run (pytest -s shows them)
        f"fleet {sizes}; eval {summary['initial_eval_reward']:.3f} -> {summary['final_eval_reward']:.3f} in "
        f"{summary['wall_seconds']:.0f}s; {len(records)} admissions, highest use "
        f"{max(live / limit for _, live, limit in records):.2f} of the limit; groups {pushed}; "
        f"buffer {summary['buffer']}"
    )


def test_a_learner_rank_joins_from_another_host(tmp_path):
    """Rank 1 runs in its own network namespace (`asyncrl learner`), meeting rank 0 over TCP only."""
    pytest.importorskip("deepspeed")
    secret = new_secret()
    env = {**os.environ, "ASYNCRL_SECRET": secret, "PYTHONUNBUFFERED": "1"}
    run_dir = tmp_path / "ranks"
    with namespace("ranks") as ns:
        args = ["--learners", "2", "--set", "run.local_learners=1", "--generators", "1", "--host", ns.outer]
        with (tmp_path / "launch.log").open("w") as log:
            launcher = subprocess.Popen(
                demo_launch_cmd(tmp_path, "ranks", *args, "--steps", "8"), cwd=ROOT, env=env, stderr=log
            )
        procs = [launcher]
        try:
            wait_for("the run", lambda: (run_dir / "run.json").is_file(), procs)
            address = json.loads((run_dir / "run.json").read_text())["redis_address"]
            cmd = [sys.executable, "-m", "asyncrl.cli", "learner", "--redis", address, "--rank", "1"]
            with (tmp_path / "rank1.log").open("w") as out:
                rank1 = subprocess.Popen(ns.cmd(*cmd), cwd=ROOT, env=env, stdout=out, stderr=out)
            procs.append(rank1)
            assert launcher.wait(timeout=600) == 0, (tmp_path / "launch.log").read_text()[-3000:]
            assert rank1.wait(timeout=120) == 0, (tmp_path / "rank1.log").read_text()[-3000:]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["final_version"] == 8
    assert summary["final_eval_reward"] > summary["initial_eval_reward"] + 0.2, summary
    trained = (tmp_path / "rank1.log").read_text()
    assert all(f"step {v} trained" in trained for v in range(1, 9))  # rank 1 took its share of every step
