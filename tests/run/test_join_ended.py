"""Joining a run that has ended is a clean no-op: ``asyncrl generator`` / ``asyncrl learner`` say so in
one line and exit 0, and the ``asyncrl slurm --join`` script turns neither that nor a head job that
already ended into an srun error.

The run is a real redis-server holding what a launcher publishes (its config, a version) and its stop
key. The join script runs under bash with stand-ins for scontrol, squeue and srun on PATH (srun runs
the command here, and reports a nonzero exit as the real one does: ``srun: error: ...``). Outcomes decide
every test, never timing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from demo_launch import DEMO, ROOT

from asyncrl.buffers import run_prefix
from asyncrl.buffers.redis_buffer import RedisBuffer
from asyncrl.control import RunControl, connect
from asyncrl.fleet.rendezvous import publish_run
from asyncrl.run import slurm
from asyncrl.secret import redis_password

SECRET = "cd" * 32
JOB = "41"


@pytest.fixture
def ended_run(make_redis_server) -> dict:
    """A run whose launcher stopped it: {address, port, prefix}."""
    server = make_redis_server(password=redis_password(SECRET))
    prefix = run_prefix("ended-0000")
    address = f"127.0.0.1:{server.port}"
    buf = RedisBuffer(server.url, prefix)
    control = RunControl(connect(server.url), prefix)
    try:
        buf.set_version(3)
        publish_run(control, DEMO.read_text(), address)
        control.request_stop("completed")
    finally:
        buf.close()
        control.r.close()
    return {"address": address, "port": server.port, "prefix": prefix}


def join_env() -> dict[str, str]:
    return {**os.environ, "ASYNCRL_SECRET": SECRET}


@pytest.mark.redis
@pytest.mark.parametrize("role", [["generator"], ["learner", "--rank", "1"]])
def test_joining_an_ended_run_says_so_in_one_line_and_exits_0(ended_run, role):
    cmd = [sys.executable, "-m", "asyncrl.cli", *role, "--redis", ended_run["address"]]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=join_env(), timeout=120)
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(lines) == 1 and "has ended" in lines[0] and ended_run["prefix"] in lines[0], lines


# -- the join script ---------------------------------------------------------------------------------
FAKE_SCONTROL = """\
#!/bin/bash
case "$1 $2" in
  "-o show") printf '%s\\n' "$FAKE_JOB_RECORD" ;;
  "show hostnames") printf '%s\\n' "$3" ;;
  *) exit 1 ;;
esac
"""
FAKE_SRUN = """\
#!/bin/bash
out=/dev/stdout
while [[ $1 == --* ]]; do
  case $1 in --output=*) out=${1#--output=} ;; esac
  shift
done
"$@" >"$out" 2>&1
rc=$?
(( rc == 0 )) || echo "srun: error: fake-node: task 0: Exited with exit code $rc" >&2
exit $rc
"""


def join_script(tmp_path: Path, port: int) -> tuple[Path, Path]:
    """The rendered join script of run ``r`` (job 41's), and a bin directory of SLURM stand-ins."""
    spec = slurm.JobSpec(
        name="r",
        run_dir=tmp_path / "r",
        workdir=ROOT,
        python=sys.executable,
        port=port,
        components=(slurm.Component("generators", 1),),
        join=JOB,
        generator_restarts=1,
        exit_wait_s=5,
        start_timeout_s=120,
    )
    spec.slurm_dir.mkdir(parents=True)
    script = tmp_path / "join.sbatch"
    script.write_text(slurm.render_join(spec))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN), ("squeue", "#!/bin/sh\nexit 0\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return script, bin_dir


def run_join(script: Path, bin_dir: Path, state: str) -> subprocess.CompletedProcess:
    record = f"JobId={JOB} HetJobOffset=0 JobName=asyncrl-r JobState={state} NodeList=n1 Comment=asyncrl;run=r"
    env = {
        **join_env(),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_JOB_RECORD": record,
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "n9",
        "ASYNCRL_HEAD_ADDR": "127.0.0.1",
    }
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("state", ["COMPLETED", "CANCELLED", "FAILED"])
def test_a_join_job_after_its_head_job_ended_is_one_line_and_exit_0(tmp_path, state):
    script, bin_dir = join_script(tmp_path, port=1)
    out = run_join(script, bin_dir, state)
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(lines) == 1 and f"job {JOB} is {state}" in lines[0] and "has ended" in lines[0], lines
    assert "error" not in lines[0]


@pytest.mark.redis
def test_a_join_job_whose_run_stopped_while_its_head_job_runs_makes_no_srun_error(ended_run, tmp_path):
    script, bin_dir = join_script(tmp_path, port=ended_run["port"])
    out = run_join(script, bin_dir, "RUNNING")
    both = out.stdout + out.stderr
    assert out.returncode == 0, both
    assert "srun: error" not in both and "Traceback" not in both and "error:" not in both, both
    logs = sorted((tmp_path / "r.slurm").glob("slurm77-n9-0*.log"))
    assert [p.name for p in logs] == ["slurm77-n9-0.log"], both  # started once: not restarted as a failure
    lines = logs[0].read_text().strip().splitlines()
    assert len(lines) == 1 and "has ended" in lines[0], lines


def test_the_rendered_join_script_parses(tmp_path):
    script, _ = join_script(tmp_path, port=1)
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert 'its run has ended; nothing to join"; exit 0' in script.read_text()
