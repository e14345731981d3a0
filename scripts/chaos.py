"""Chaos run: one long demo run under random kills; at the end, nothing lost, nothing over-trained.

Over one run (``--steps``, default 300) it sends at least ``--events`` (default 30) kills at random
times (a seeded, printed RNG): ``kill -9`` of a random generator, of a random learner rank, of the
redis-server, and of the launcher itself, which is then followed by ``asyncrl launch --resume``. The
launcher restarts the first three by itself (the run's restart budgets are raised for this). A learner
or launcher kill waits until the run got past the version of the previous one, so the run progresses.
Every few seconds it samples ``asyncrl status``. At the end it checks, and prints:

- ``lost == 0`` in the buffer's accounting identity;
- no group trained more often than ``buffer.replay_times`` in the final model's lineage: for every
  version 1..N the last execution of the step that made it (learner logs ``step v trained <ids>``),
  since a restart from the committed checkpoint c redoes, and so replaces, every step after c;
- the admission bound in every status sample: ``live <= (version + k + 1) * B``;
- no process of the run left (every pid any ``run.json`` named), its redis port closed, no
  shared-memory segment of its learners left.

    .venv/bin/python scripts/chaos.py [--steps 300] [--events 30] [--seed N]

Exit 0 only if every check holds. A run takes about 10-15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.rundir import pid_alive  # noqa: E402

KINDS = ("generator", "learner", "redis", "launcher")
DISRUPTIVE = ("learner", "launcher")  # these send the learners back to the committed checkpoint
STEP_LINE = re.compile(r"^(\S+ \S+) learner-\d+ INFO asyncrl.learner: step (\d+) trained (.*)$")


def launch_cmd(out_dir: Path, steps: int, lag: int) -> list[str]:
    sets = {
        "run.out_dir": str(out_dir),
        "run.max_generator_restarts": 1000,
        "run.max_redis_restarts": 1000,
        "learner.max_restarts": 1000,
        "learner.checkpoint_every": 5,
        "run.eval_every": 0,
    }
    cmd = [sys.executable, "-m", "asyncrl.cli", "launch", "--config", "configs/demo-cpu.yaml", "--name", "chaos"]
    cmd += ["--steps", str(steps), "--max-policy-lag", str(lag)]
    return cmd + [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


def resume_cmd(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", "launch", "--resume", str(run_dir)]


def start(cmd: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def read_info(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return None


def status(run_dir: Path) -> dict | None:
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "status", "--run", str(run_dir), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def version_of(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    out = 0
    for line in path.read_text().splitlines():
        try:
            out = max(out, int(json.loads(line).get("learner/version", 0)))
        except (ValueError, AttributeError):
            continue
    return out


def lineage_uses(run_dir: Path, steps: int) -> collections.Counter:
    """Uses of each group id in the final model: per rank, the last logged execution of each step."""
    uses: collections.Counter = collections.Counter()
    for log_path in sorted((run_dir / "logs").glob("learner-*.log")):
        last: dict[int, list[str]] = {}
        for line in log_path.read_text(errors="replace").splitlines():
            m = STEP_LINE.match(line)
            if m:
                last[int(m[2])] = m[3].split()
        missing = [v for v in range(1, steps + 1) if v not in last]
        if missing:
            raise SystemExit(f"{log_path.name}: no logged step for versions {missing[:10]}")
        for ids in last.values():
            uses.update(ids)
    return uses


class Chaos:
    """The state of one chaos run: what was killed, every pid seen, the admission samples."""

    def __init__(self, args, run_dir: Path, groups_per_step: int) -> None:
        self.args, self.run_dir, self.groups_per_step = args, run_dir, groups_per_step
        self.rng = random.Random(args.seed)
        self.events: collections.Counter = collections.Counter()
        self.every_pid: dict[int, str] = {}
        self.bound_violations: list[tuple[int, int, int]] = []
        self.samples = self.high_water = 0
        self.disrupted_at = -1
        self.t0 = time.monotonic()

    def note_pids(self, info: dict) -> None:
        self.every_pid.update({pid: name for name, pid in info.get("pids", {}).items()})
        self.every_pid[info["launcher_pid"]] = "launcher"
        if info.get("redis_pid"):
            self.every_pid[info["redis_pid"]] = "redis-server"

    def sample_admission(self) -> None:
        st = status(self.run_dir)
        if st is None or not st.get("buffer"):
            return
        # admission is keyed on the version a generator serves, never above the newest one published;
        # after a learner restart the learner's version goes back, the bound does not
        self.high_water = max(self.high_water, int(st["version"] or 0))
        self.samples += 1
        bound = (self.high_water + self.args.lag + 1) * self.groups_per_step
        if st["buffer"]["live"] > bound:
            self.bound_violations.append((self.high_water, st["buffer"]["live"], bound))

    def pick(self, info: dict) -> tuple[str, int] | None:
        """(kind, pid) of the next kill, or None when that kind has nothing alive to kill."""
        kind, now = self.rng.choice(KINDS), version_of(self.run_dir)
        if kind in DISRUPTIVE and now <= self.disrupted_at:  # let the learners get past the last one first
            kind = self.rng.choice([k for k in KINDS if k not in DISRUPTIVE])
        pids = info.get("pids", {})
        victims = {
            "generator": [p for n, p in pids.items() if n.startswith("generator")],
            "learner": [p for n, p in pids.items() if n.startswith("learner")],
            "redis": [info["redis_pid"]] if info.get("redis_pid") else [],
            "launcher": [info["launcher_pid"]],
        }[kind]
        victims = [p for p in victims if pid_alive(p)]
        if not victims:
            return None
        if kind in DISRUPTIVE:
            self.disrupted_at = now
        return kind, self.rng.choice(victims)

    def kill(self, kind: str, pid: int) -> None:
        print(f"[{time.monotonic() - self.t0:5.0f}s] v{version_of(self.run_dir):<4} kill -9 {kind} ({pid})", flush=True)
        os.kill(pid, signal.SIGKILL)
        self.events[kind] += 1


def wait_children_gone(info: dict, timeout_s: float = 60) -> list[int]:
    """After the launcher's death: the pids of its children still running after ``timeout_s``."""
    children = [p for p in [*info.get("pids", {}).values(), info.get("redis_pid")] if p]
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in children if pid_alive(p)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--events", type=int, default=30)
    ap.add_argument("--lag", type=int, default=1)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--min-gap", type=float, default=6.0, help="seconds between kills, at least")
    ap.add_argument("--max-gap", type=float, default=20.0, help="seconds between kills, at most")
    ap.add_argument("--out", help="keep the run here (default: a temporary directory)")
    args = ap.parse_args()
    print(f"chaos: seed {args.seed}, {args.events} events, {args.steps} steps", flush=True)
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="asyncrl-chaos-"))
    run_dir = out_dir / "chaos"
    cfg = yaml.safe_load((ROOT / "configs/demo-cpu.yaml").read_text())
    chaos = Chaos(args, run_dir, int(cfg["learner"]["groups_per_step"]))
    log = open(out_dir / "launcher.out", "ab")
    proc = start(launch_cmd(out_dir, args.steps, args.lag), log)
    try:
        while proc.poll() is None:
            time.sleep(chaos.rng.uniform(args.min_gap, args.max_gap))
            info = read_info(run_dir)
            if info is None or proc.poll() is not None:
                continue
            chaos.note_pids(info)
            chaos.sample_admission()
            if sum(chaos.events.values()) >= args.events or (picked := chaos.pick(info)) is None:
                continue  # enough chaos (let it finish), or nothing of that kind alive now
            chaos.kill(*picked)
            if picked[0] == "launcher":
                proc.wait(timeout=60)
                if left := wait_children_gone(info):
                    print(f"FAIL: children outlived their launcher: {left}", flush=True)
                    return 1
                proc = start(resume_cmd(run_dir), log)
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    chaos.note_pids(read_info(run_dir) or {"launcher_pid": proc.pid})
    return report(chaos, code, time.monotonic() - chaos.t0)


def report(chaos: Chaos, code: int, wall: float) -> int:
    run_dir, args, events = chaos.run_dir, chaos.args, chaos.events
    every_pid, samples, bound_violations = chaos.every_pid, chaos.samples, chaos.bound_violations
    summary = json.loads((run_dir / "summary.json").read_text())
    buffer = summary.get("buffer") or {}
    uses = lineage_uses(run_dir, args.steps)
    budget = summary.get("restarts", {})
    replay_times = int(yaml.safe_load((run_dir / "config.yaml").read_text())["buffer"]["replay_times"])
    over = {gid: n for gid, n in uses.items() if n > replay_times}
    alive = {pid: name for pid, name in every_pid.items() if pid_alive(pid)}
    url = (run_dir / "redis.url").read_text().strip() if (run_dir / "redis.url").exists() else ""
    port = int(url.rsplit(":", 1)[1].split("/")[0]) if url else None
    port_open = False
    if port:
        with socket.socket() as s:
            port_open = s.connect_ex(("127.0.0.1", port)) == 0
    shm = [p for p in Path("/dev/shm").glob("asyncrl-w-*") if not pid_alive(int(p.name.split("-")[2]))]
    checks = {
        "exit 0 (completed)": code == 0 and summary.get("exit_reason") == "completed",
        f"events >= {args.events}": sum(events.values()) >= args.events,
        "lost == 0": buffer.get("lost") == 0,
        f"no group trained beyond replay_times ({replay_times}) in the lineage": not over,
        f"admission bound in every status sample ({samples})": not bound_violations,
        f"max staleness <= k ({args.lag})": summary.get("max_staleness_seen", 99) <= args.lag,
        "no process of the run left": not alive,
        "redis port closed": not port_open,
        "no shm segment of a dead learner left": not shm,
    }
    print(f"chaos: {dict(events)} in {wall:.0f}s; last launch's restarts {budget}")
    print(f"buffer: {buffer}")
    print(f"lineage: {len(uses)} groups in {args.steps} versions; most uses {max(uses.values(), default=0)}")
    print(f"final eval reward {summary.get('final_eval_reward')}, first {summary.get('initial_eval_reward')}")
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    if over:
        print(f"  over-trained: {dict(list(over.items())[:5])}")
    if bound_violations:
        print(f"  bound violations (version, live, bound): {bound_violations[:5]}")
    if alive:
        print(f"  left running: {alive}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
