"""``asyncrl slurm``: the rendered sbatch scripts, and the demo as a heterogeneous job on a real SLURM.

The unit tests read the scripts (components, srun lines, no secret, ``bash -n``). The end-to-end tests
start a SLURM cluster of their own on this machine (``scripts/ci/local-slurm``: 3 virtual nodes of 2
CPUs, on ports apart from a developer's default cluster) and stop it again if they started it. Their
order of events never rests on timing: a generator the test wants out of the way is SIGSTOPped the
moment its process exists (it has not joined yet; if it had, its lease would expire and be reaped),
so the run can only finish through the process the test means to prove.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from demo_launch import ROOT
from services import in_ci, require_redis_binary

from asyncrl.cli import build_parser
from asyncrl.errors import UserError
from asyncrl.run import slurm

SECRET = "ab" * 32
SLURM_SCRIPTS = ROOT / "scripts" / "ci" / "local-slurm"
CLUSTER = {  # the test cluster: a het job needs a node per component, the join job a third
    "SLURM_LOCAL_BASE": f"/tmp/asyncrl-test-slurm-{os.getuid()}",
    "SLURM_LOCAL_NODES": "3",
    "SLURM_LOCAL_CPUS": "2",
    "SLURM_LOCAL_PORT": "7817",
}
PARTITIONS = ["--partition-learners", "learn", "--partition-generators", "gen"]
# the demo, small: one learner rank, the transformers engine (starts in seconds), 12 steps; it goes
# 0.22 -> about 0.85 (measured 0.865); the bar is the e2e test's, +0.2
FAST = ["run.steps=12", "run.learners=1", "run.eval_every=0", "generator.engine.type=hf"]
QUALITY_MARGIN = 0.2


def slurm_args(*argv: str):
    return build_parser().parse_args(["slurm", *argv])


def render_main(tmp_path: Path, *argv: str) -> str:
    args = slurm_args("--config", "configs/demo-cpu.yaml", "--set", f"run.out_dir={tmp_path}", *argv)
    return slurm.render(slurm.spec_from_args(args))


def bash_n(text: str, tmp_path: Path) -> None:
    path = tmp_path / "check.sbatch"
    path.write_text(text)
    out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


# -- rendering --------------------------------------------------------------------------------------
def test_main_script_has_het_components_and_srun_lines(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("ASYNCRL_SECRET", SECRET)
    text = render_main(tmp_path, "--name", "r", "--generator-nodes", "3", "--generators-per-node", "2", *PARTITIONS)
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch[3].startswith("#SBATCH --partition=learn --nodes=1 ") and "--cpus-per-task=2" in sbatch[3]
    assert sbatch[4] == "#SBATCH hetjob"
    assert sbatch[5].startswith("#SBATCH --partition=gen --nodes=3 --ntasks-per-node=2 --cpus-per-task=1")
    assert f"#SBATCH --output={tmp_path}/r.slurm/job-%j.out" in sbatch
    comment = next(line for line in sbatch if "--comment=" in line).split("=", 1)[1]
    port = int(slurm.parse_comment(comment)["port"])
    assert slurm.parse_comment(comment) == {"run": "r", "port": str(port), "dir": str(tmp_path / "r")}
    assert 'srun --het-group=0 --nodes=1 --ntasks=1 --nodelist="$HEAD_NODE" --job-name=asyncrl-head' in text
    assert 'srun --het-group=1 --nodes=1 --ntasks=1 --nodelist="$node" --overlap' in text
    assert 'launch --name r --generators 0 --host "$HEAD_ADDR" --set "run.redis_port=$PORT"' in text
    assert f"PORT={port}\n" in text and 'generator --redis "$HEAD_ADDR:$PORT"' in text
    assert "${SLURM_JOB_NODELIST_HET_GROUP_0:-" in text and 'start_generators "$SLURM_JOB_NODELIST_HET_GROUP_1"' in text
    assert SECRET not in text and "ASYNCRL_SECRET=$(random_hex)" in text
    assert "set -x" not in text and "pkill" not in text and "killall" not in text
    bash_n(text, tmp_path)


def test_reward_component_and_head_only_job(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    text = render_main(tmp_path, "--name", "rw", "--reward-nodes", "1", "--reward", "asyncrl.demo.sort:reward",
                       "--reward-port", "24000")  # fmt: skip
    assert text.count("#SBATCH hetjob") == 2 and "# component 2: reward" in text
    assert "srun --het-group=2 " in text and "reward-serve --reward asyncrl.demo.sort:reward" in text
    assert '--set "data.reward=http://$REWARD_ADDR:24000/score"' in text
    assert '--token-file "$SLURM_DIR/reward.token"' in text and "$SLURM_JOB_NODELIST_HET_GROUP_2" in text
    bash_n(text, tmp_path)
    alone = render_main(tmp_path, "--name", "h", "--generator-nodes", "0")  # a head that generators join
    assert "hetjob" not in alone and "--het-group" not in alone and 'start_generators "' not in alone
    bash_n(alone, tmp_path)


def test_join_script_reads_the_head_job(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = (f"JobId=41 HetJobId=41 HetJobOffset=0 JobName=asyncrl-r JobState=RUNNING NodeList=n[3-4] "
              f"Comment=asyncrl;run=r;port=23456;dir={tmp_path}/r WorkDir=/x")  # fmt: skip
    fake = bin_dir / "scontrol"
    fake.write_text(f"#!/bin/sh\necho '{record}'\necho 'JobId=42 HetJobId=41 HetJobOffset=1 NodeList=n5'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert slurm.parse_job_records(record)[0]["NodeList"] == "n[3-4]"
    spec = slurm.join_spec_from_args(
        slurm_args("--join", "41", "--generator-nodes", "2", "--partition-generators", "gen")
    )
    assert (spec.name, spec.port, spec.run_dir, spec.join) == ("r", 23456, tmp_path / "r", "41")
    text = slurm.render_join(spec)
    assert "hetjob" not in text and "#SBATCH --partition=gen --nodes=2 " in text and "JOIN_JOB=41\n" in text
    assert 'start_generators "$SLURM_JOB_NODELIST"' in text and "PORT=23456\n" in text
    assert "--het-group" not in text and 'ASYNCRL_SECRET=$(<"$RUN_DIR/secret")' in text and "--secret-file" not in text
    bash_n(text, tmp_path)
    with pytest.raises(UserError, match="runs 'r', not 'other'"):
        slurm.join_spec_from_args(slurm_args("--join", "41", "--name", "other"))


def test_more_learner_nodes_run_asyncrl_learner_ranks(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    text = render_main(tmp_path, "--name", "wide", "--learner-nodes", "2")  # the demo: 2 ranks a node
    assert "--nodes=2 --ntasks-per-node=1" in text.split("hetjob")[0]  # component 0: two learner nodes
    assert "--set run.learners=4 --set run.local_learners=2" in text
    assert 'learner --redis "$HEAD_ADDR:$PORT" --rank "$rank" --local-rank "$i"' in text
    assert 'wait_reachable "the head" "$HEAD_ADDR" "$PORT" "$HEAD_PID" && start_learners' in text
    bash_n(text, tmp_path)
    assert "start_learners" not in render_main(tmp_path, "--name", "narrow")


def test_what_the_renderer_refuses(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    (tmp_path / "taken").mkdir()
    with pytest.raises(UserError, match="exists"):
        render_main(tmp_path, "--name", "taken")
    with pytest.raises(UserError, match="--learner-nodes"):
        render_main(tmp_path, "--name", "x", "--learner-nodes", "0")
    with pytest.raises(UserError, match="divisible"):  # 3 nodes x 2 ranks do not split 8 groups a step
        render_main(tmp_path, "--name", "x", "--learner-nodes", "3")
    with pytest.raises(UserError, match="--reward MODULE:FUNCTION"):
        render_main(tmp_path, "--name", "x", "--reward-nodes", "1")
    with pytest.raises(UserError, match="--generator-nodes"):
        slurm.join_spec_from_args(slurm_args("--join", "7", "--generator-nodes", "0"))
    assert slurm.parse_comment("something else") == {}


def test_cli_writes_the_script(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "slurm", "--config", "configs/demo-cpu.yaml", "--name", "c",
         "--set", f"run.out_dir={tmp_path}"],  # fmt: skip
        capture_output=True, text=True, timeout=60, env={**os.environ, "ASYNCRL_SECRET": SECRET},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path == tmp_path / "c.slurm" / "job.sbatch" and SECRET not in path.read_text()
    assert not (tmp_path / "c").exists()  # the head alone creates the run directory


# -- on a real SLURM --------------------------------------------------------------------------------
def _daemon_alive(base: Path) -> bool:
    try:
        pid = int((base / "run" / "slurmctld.pid").read_text())
        return "slurmctld" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError):
        return False


@pytest.fixture(scope="module")
def cluster():
    """Environment (SLURM_CONF) of a running local cluster; started here, stopped here if it was."""
    if shutil.which("sbatch") is None and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        msg = "SLURM is not installed and cannot be (needs root and apt-get)"
        pytest.fail(msg + "; CI=true, so this is a failure") if in_ci() else pytest.skip(msg)
    require_redis_binary()
    env = {**os.environ, **CLUSTER}
    base = Path(CLUSTER["SLURM_LOCAL_BASE"])
    started = not _daemon_alive(base)
    out = subprocess.run(["bash", str(SLURM_SCRIPTS / "start_local_slurm.sh")], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    env["SLURM_CONF"] = str(base / "etc" / "slurm.conf")
    env.pop("ASYNCRL_SECRET", None)  # the job makes its own
    yield env
    if started:
        subprocess.run(["bash", str(SLURM_SCRIPTS / "stop_local_slurm.sh")], env=env, capture_output=True,
                       timeout=120)  # fmt: skip


class Jobs:
    """The test's SLURM jobs: submitted through the CLI, waited for, cancelled by id at the end."""

    def __init__(self, env: dict, out_dir: Path):
        self.env, self.out_dir, self.ids = env, out_dir, []

    def sh(self, *cmd: str) -> str:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60).stdout

    def submit(self, *argv: str) -> tuple[Path, str]:
        out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "slurm", *argv, "--submit"], cwd=ROOT,
                             env=self.env, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr
        script, jobid = out.stdout.split()
        self.ids.append(jobid)
        return Path(script), jobid

    def submit_run(self, name: str, *argv: str, exit_wait_s: int = 20) -> tuple[Path, str]:
        sets = [x for s in [f"run.out_dir={self.out_dir}", *FAST] for x in ("--set", s)]
        return self.submit("--config", "configs/demo-cpu.yaml", "--name", name, *PARTITIONS, *sets,
                           "--exit-wait-s", str(exit_wait_s), "--time", "15", *argv)  # fmt: skip

    def queued(self, jobid: str) -> bool:
        return bool(self.sh("squeue", "-h", "-j", jobid, "-o", "%i").strip())

    def state(self, jobid: str) -> dict[str, str]:
        return slurm.parse_job_records(self.sh("scontrol", "-o", "show", "job", jobid))[0]

    def steps(self) -> str:
        return self.sh("squeue", "-h", "-s", "-o", "%i %j").strip()

    def cancel_all(self) -> None:
        for jobid in self.ids:
            if self.queued(jobid):
                self.sh("scancel", jobid)


@pytest.fixture
def jobs(cluster, tmp_path):
    j = Jobs(cluster, tmp_path)
    yield j
    j.cancel_all()


def wait_for(predicate, timeout_s: float, what: str, output: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            tail = output.read_text()[-3000:] if output is not None and output.exists() else ""
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{tail}")
        time.sleep(0.1)
    return value


def generator_pid(id_prefix: str) -> int | None:
    """The python process of the generator whose --id starts with ``id_prefix`` (not its srun)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if Path(argv[0]).name.startswith("python") and "generator" in argv and "--id" in argv:
            if argv[argv.index("--id") + 1].startswith(id_prefix):
                return int(proc.name)
    return None


def cmdlines_with(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            line = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in line and proc.name.isdigit() and int(proc.name) != os.getpid():
            found.append(f"{proc.name}: {line.replace(chr(0), ' ')[:200]}")
    return found


@pytest.mark.slow
@pytest.mark.redis
def test_het_job_runs_the_demo_survives_a_killed_generator_and_takes_a_joined_one(jobs, tmp_path):
    """The run has two generators of its own job in turn (the first SIGKILLed and restarted, each
    SIGSTOPped before it joins) and one of a --join job: the run completes only through the joined one."""
    # the job's own generator is SIGSTOPped when the run ends: it cannot leave, so the job's exit wait is spent
    # in full before its step is cancelled (the join job's generator leaves by itself, within its 20 s)
    script, job = jobs.submit_run("het", exit_wait_s=2)
    run_dir, out = tmp_path / "het", tmp_path / "het.slurm" / f"job-{job}.out"
    first = wait_for(lambda: generator_pid(f"slurm{job}-"), 300, "the job's generator", out)
    os.kill(first, signal.SIGKILL)  # a crashed generator step: started again under a new id
    wait_for(lambda: "restarting it (1/3)" in out.read_text(), 120, "the restart", out)
    second = wait_for(lambda: generator_pid(f"slurm{job}-vm-1-0-r1"), 120, "the restarted generator", out)
    os.kill(second, signal.SIGSTOP)
    secret = (run_dir / "secret").read_text().strip()
    assert len(secret) == 64 and not cmdlines_with(secret)
    _, join = jobs.submit("--join", job, "--generator-nodes", "1", "--partition-generators", "gen",
                          "--exit-wait-s", "20", "--time", "15")  # fmt: skip
    wait_for(lambda: not jobs.queued(job), 420, "the run's job to end", out)  # cancels the stopped one's step
    wait_for(lambda: not jobs.queued(join), 120, "the join job to end", tmp_path / "het.slurm" / f"join-{join}.out")
    text = out.read_text()
    assert "restarting it (2/3)" not in text and "expired" not in text, text  # no restart once the run ended
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["final_version"] == 12, text[-3000:]
    assert summary["final_eval_reward"] > summary["initial_eval_reward"] + QUALITY_MARGIN, summary
    st = subprocess.run([sys.executable, "-m", "asyncrl.cli", "status", "--run", str(run_dir), "--json"],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    seen = json.loads(st.stdout)["generators"]
    assert any(g.startswith(f"slurm{join}-") for g in seen), seen
    assert jobs.state(job)["JobState"] == "COMPLETED" and jobs.state(job)["ExitCode"] == "0:0"
    assert jobs.state(join)["JobState"] == "COMPLETED"
    assert jobs.sh("squeue", "-h").strip() == "" and jobs.steps() == ""
    for path in [script, out, *(tmp_path / "het.slurm").glob("*.log"), *(run_dir / "logs").glob("*")]:
        assert secret not in path.read_text(errors="replace"), path
    assert wait_for(lambda: not cmdlines_with(str(run_dir)), 30, "the run's processes to end") is True


@pytest.mark.slow
@pytest.mark.redis
def test_a_killed_head_step_fails_the_job(jobs, tmp_path):
    _, job = jobs.submit_run("dies")
    run_dir, out = tmp_path / "dies", tmp_path / "dies.slurm" / f"job-{job}.out"
    wait_for(lambda: (run_dir / "run.json").exists(), 300, "the head to start", out)
    head = wait_for(lambda: [s.split()[0] for s in jobs.steps().splitlines() if s.endswith(" asyncrl-head")], 60,
                    "the head step")  # fmt: skip
    jobs.sh("scancel", head[0])
    wait_for(lambda: not jobs.queued(job), 120, "the job to end", out)
    state = jobs.state(job)
    assert state["JobState"] == "FAILED" and state["ExitCode"] != "0:0", state
    assert "error: the head step (redis-server + learners on vm-0) exited with code" in out.read_text()
    assert jobs.sh("squeue", "-h").strip() == "" and jobs.steps() == ""
    assert wait_for(lambda: not cmdlines_with(str(run_dir)), 30, "the run's processes to end") is True


@pytest.mark.slow
@pytest.mark.redis
def test_learner_ranks_on_two_nodes_train_the_demo(jobs, tmp_path):
    """Component 0 of two nodes: the head's rank 0 and, on the second node, rank 1 (`asyncrl learner`)."""
    _, job = jobs.submit_run("wide", "--learner-nodes", "2", "--set", "run.steps=6")
    run_dir, slurm_dir = tmp_path / "wide", tmp_path / "wide.slurm"
    out = slurm_dir / f"job-{job}.out"
    wait_for(lambda: not jobs.queued(job), 420, "the job to end", out)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["final_version"] == 6, out.read_text()[-3000:]
    assert summary["final_eval_reward"] > summary["initial_eval_reward"] + QUALITY_MARGIN, summary
    rank1 = (slurm_dir / "learner-1.log").read_text()
    assert all(f"step {v} trained" in rank1 for v in range(1, 7))  # rank 1 took its share of every step
    assert jobs.state(job)["JobState"] == "COMPLETED" and jobs.steps() == ""
