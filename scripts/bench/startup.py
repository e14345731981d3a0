"""Start-up and shut-down time of the demo launch, phase by phase (issue 14).

Runs the real `asyncrl launch --config configs/demo-cpu.yaml` for a few steps and prints, from the
run's own logs and metrics, when each phase was reached (seconds since the launch; "first" and "last"
over the processes that reach it), then the two figures:

    .venv/bin/python scripts/bench/startup.py --repeat 3
    RESULT first_step_s <s>   # launch -> the first learner step's end (metrics' time/step_end_at)
    RESULT shutdown_s <s>     # the last learner step's end -> the launcher's exit

Sources: redis-server's log ("Ready to accept connections"), each process's log line of a phase
(learner "rank r ready", engine "vllm imported" / "vllm engine up" / "first engine step done",
generator "up" / "pushed its first group", rank 0 "final checkpoint and export written"), the
metrics' step and eval records, and this script's own polling of the pids in run.json (when each
process exited). Timings on a shared machine are noisy: the load is printed with each run, and
--repeat N prints the median of every phase over N runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.01  # how often the pids are looked at: the exit times are this exact

# (phase, log-file glob, the line's text): the time of the line in each matching log
LOG_PHASES = [
    ("learner ranks ready", "learner-*.log", " ready at version "),
    ("generator imports done", "generator-*.log", "asyncrl.engine: vllm imported"),
    ("engine up", "generator-*.log", "asyncrl.engine: vllm engine up"),
    ("generator loop up", "generator-*.log", "asyncrl.generator: generator "),
    ("warm-up done (first engine step)", "generator-*.log", "asyncrl.engine: first engine step done"),
    ("first group pushed", "generator-*.log", " pushed its first group"),
    ("checkpoint/export", "learner-*.log", "final checkpoint and export written"),
    ("publisher closed", "learner-*.log", "publisher closed"),
]
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_REDIS_TIME = re.compile(r"^\d+:\w (\d\d \w{3} \d{4} \d\d:\d\d:\d\d\.\d{3}) .*Ready to accept connections")


def launch_cmd(out_dir: Path, name: str, steps: int, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "asyncrl.cli", "launch", "--config", "configs/demo-cpu.yaml", "--name", name,
        "--steps", str(steps), "--set", f"run.out_dir={out_dir}", *extra,
    ]  # fmt: skip


class ExitWatch(threading.Thread):
    """Polls the launcher and the pids run.json names (redis-server's too): when each exited, and the
    CPU seconds each had used at every poll."""

    def __init__(self, run_dir: Path, launcher_pid: int):
        super().__init__(daemon=True)
        self.run_dir, self.done = run_dir, threading.Event()
        self.exited: dict[str, float] = {}  # name -> time it was first seen gone
        self.pids: dict[str, int] = {"launcher": launcher_pid}
        self.cpu: dict[str, list[tuple[float, float]]] = {}  # name -> [(time, CPU seconds so far)]

    def run(self) -> None:
        while not self.done.is_set():
            try:
                info = json.loads((self.run_dir / "run.json").read_text())
                for name, pid in {**info.get("pids", {}), "redis-server": info.get("redis_pid")}.items():
                    if isinstance(pid, int) and self.pids.get(name) != pid:  # new, or restarted
                        self.pids[name] = pid
                        self.exited.pop(name, None)
            except (OSError, ValueError):
                pass
            now = time.time()
            for name, pid in self.pids.items():
                if name in self.exited:
                    continue
                state, cpu = _stat(pid)
                if cpu is not None:
                    self.cpu.setdefault(name, []).append((now, cpu))
                if state in (None, "Z", "X"):  # a zombie (not reaped yet) has exited
                    self.exited[name] = now
            time.sleep(POLL_S)

    def cpu_at(self, when: float) -> float:
        """CPU seconds every watched process had used by ``when``."""
        return sum(max((c for t, c in series if t <= when), default=0.0) for series in self.cpu.values())


_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[str | None, float | None]:
    """(state, user + system CPU seconds) of ``pid``; (None, None) once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None, None
    return fields[0], (int(fields[11]) + int(fields[12])) / _TICK


def log_times(run_dir: Path, pattern: str, text: str) -> list[float]:
    """The time of the first line containing ``text`` in each log matching ``pattern``."""
    times = []
    for path in sorted((run_dir / "logs").glob(pattern)):
        for line in path.read_text(errors="replace").splitlines():
            m = _LOG_TIME.match(line)
            if m and text in line:
                when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
                times.append(when.timestamp())
                break
    return times


def redis_ready(run_dir: Path) -> list[float]:
    try:
        lines = (run_dir / "redis" / "redis.log").read_text(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        m = _REDIS_TIME.match(line)
        if m:
            return [datetime.datetime.strptime(m.group(1), "%d %b %Y %H:%M:%S.%f").timestamp()]
    return []


def run_once(out_dir: Path, name: str, steps: int, extra: list[str]) -> dict[str, tuple[float, float] | None]:
    """One launch; {phase: (first, last) seconds since the launch, or None where it left no trace}."""
    run_dir = out_dir / name
    shutil.rmtree(run_dir, ignore_errors=True)  # logs are appended to: each launch starts from none
    t0 = time.time()
    proc = subprocess.Popen(
        launch_cmd(out_dir, name, steps, extra), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    watch = ExitWatch(run_dir, proc.pid)
    watch.start()
    out, _ = proc.communicate()
    t_exit = time.time()
    time.sleep(5 * POLL_S)
    watch.done.set()
    watch.join()
    if proc.returncode != 0:
        sys.exit(f"launch {name} failed ({proc.returncode}):\n{out[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_ends = [r["time/step_end_at"] for r in records if "time/step_end_at" in r]
    final_eval = [r["time"] for r in records if r.get("eval/version") == steps and "time" in r]
    final_eval_start = [r["time"] - r["eval/seconds"] for r in records if r.get("eval/version") == steps]
    learners = [t for n, t in watch.exited.items() if n.startswith("learner")]
    generators = [t for n, t in watch.exited.items() if n.startswith("generator")]
    found: dict[str, list[float]] = {"launcher start": [t0], "redis up": redis_ready(run_dir)}
    for phase, pattern, text in LOG_PHASES[:6]:
        found[phase] = log_times(run_dir, pattern, text)
    found["first learner step"] = step_ends[:1]
    found["last learner step"] = step_ends[-1:]
    found["final eval started"] = final_eval_start
    found["final eval"] = final_eval
    for phase, pattern, text in LOG_PHASES[6:]:
        found[phase] = log_times(run_dir, pattern, text)
    found["learners exited"] = learners
    found["generators exited"] = generators
    found["redis-server exited"] = [watch.exited["redis-server"]] if "redis-server" in watch.exited else []
    found["every process exited"] = [max(watch.exited.values())] if watch.exited else []
    found["launcher exit"] = [t_exit]
    phases = {p: (min(ts) - t0, max(ts) - t0) if ts else None for p, ts in found.items()}
    phases["RESULT first_step_s"] = _point(step_ends[0] - t0) if step_ends else None
    # CPU seconds (all processes) before the first step: on an idle machine first_step_s >= this / cores
    phases["cpu seconds to the first step"] = _point(watch.cpu_at(step_ends[0])) if step_ends else None
    for who, series in sorted(watch.cpu.items()):
        phases[f"cpu seconds in all: {who}"] = _point(series[-1][1])
    phases["RESULT shutdown_s"] = _point(t_exit - step_ends[-1]) if step_ends else None
    return phases


def _point(x: float) -> tuple[float, float]:
    return x, x


def show(phases: dict[str, tuple[float, float] | None], title: str) -> None:
    print(f"{title}\n  {'phase':34s} {'first':>7s} {'last':>7s}")
    for phase, span in phases.items():
        if phase.startswith("RESULT"):
            continue
        if phase.startswith("cpu seconds to") and span is not None:
            print(f"  {phase} (an idle machine's floor is this / cpus): {span[0]:.2f}")
            continue
        if phase.startswith("cpu seconds in all:") and span is not None:
            print(f"  {phase:34s} {span[0]:7.2f}")
            continue
        if span is None:
            print(f"  {phase:34s} {'-':>7s}")
        elif abs(span[1] - span[0]) < 5e-4:
            print(f"  {phase:34s} {span[0]:7.2f}")
        else:
            print(f"  {phase:34s} {span[0]:7.2f} {span[1]:7.2f}")


def median(runs: list[dict]) -> dict[str, tuple[float, float] | None]:
    out = {}
    for phase in runs[0]:
        spans = [r[phase] for r in runs if r.get(phase) is not None]
        out[phase] = (statistics.median(s[0] for s in spans), statistics.median(s[1] for s in spans)) if spans else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="launches; the figures are their medians")
    ap.add_argument("--steps", type=int, default=3, help="learner steps of each launch (run.steps)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra --set overrides (repeatable)")
    ap.add_argument("--keep", metavar="DIR", help="write the runs under DIR and keep them (default: a temp dir)")
    args = ap.parse_args()
    extra = [x for o in args.extra for x in ("--set", o)]
    out_dir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="asyncrl-startup-"))
    runs = []
    try:
        for i in range(args.repeat):
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            runs.append(run_once(out_dir.resolve(), f"startup-{i}", args.steps, extra))
            show(runs[-1], f"run {i + 1}/{args.repeat} (load average before it: {load}; {os.cpu_count()} cpus)")
    finally:
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)
    result = median(runs)
    if args.repeat > 1:
        show(result, f"median of {args.repeat} runs")
    for name in ("first_step_s", "shutdown_s"):
        span = result[f"RESULT {name}"]
        print(f"RESULT {name} {span[0]:.2f}" if span else f"RESULT {name} nan")


if __name__ == "__main__":
    main()
