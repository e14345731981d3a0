"""Episodes that outlive their generator: ``kill -9`` of a generator mid-run, long episodes in ``env-serve``.

The guess demo with episodes of up to 6 turns, each environment step taking 1 s (``latency_s``), the
environment served by ``asyncrl env-serve`` (``faulty:LoggedGuessEnv``, which logs every step it runs).
Each time the environment has run ``--every`` more steps, generator-0 is killed with SIGKILL (``--kills``
times); the launcher restarts it and the restart (or the other generator) resumes the dead one's
episodes from their journals (``asyncrl.generators.journal``). Printed:

* ``steps_redone``: environment steps run twice for one episode (the same seed and step in the log);
* ``turns_resumed``: the model turns (each with its environment step) the journals kept, which a
  restart from turn 0 would have played again;
* the buffer's ``lost`` and ``unfinished``, the run's end, and the learner's behaviour log-prob mismatch
  and the weight-sync probe (engine against learner, per version) of the run.

    .venv/bin/python scripts/bench/resume.py --kills 2
    RESULT resume_steps_redone_per_kill 0.0
    RESULT resume_turns_resumed_per_kill 96.5
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent
READY_S = 120.0


def start_env_serve(tmp: Path, env: dict) -> tuple[subprocess.Popen, str]:
    """``asyncrl env-serve`` of the logged guess game on loopback: (process, URL with its token)."""
    cmd = [sys.executable, "-m", "asyncrl.cli", "env-serve", "--env", "faulty:LoggedGuessEnv", "--workers", "2",
           "--port", "0", "--token-file", str(tmp / "env.token")]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + READY_S
    while (line := lines.get(timeout=max(0.1, deadline - time.monotonic()))) is not None:
        if " at http://" in line:
            url = line.split(" at ", 1)[1].split()[0]
            return proc, url.replace("http://", f"http://:{(tmp / 'env.token').read_text().strip()}@", 1)
    raise SystemExit(f"env-serve exited with {proc.wait()}")


def logged_steps(log: Path) -> list[tuple[str, str]]:
    """(seed, step) of every step the environment ran."""
    if not log.exists():
        return []
    return [tuple(line.split(" ", 2)[:2]) for line in log.read_text().splitlines() if line]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--every", type=int, default=150, help="environment steps between kills")
    ap.add_argument("--steps", type=int, default=10, help="learner steps of the run")
    ap.add_argument("--latency-s", type=float, default=1.0)
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra --set overrides")
    ap.add_argument("--out", type=Path, help="keep the run directory and the step log here (default: a temporary one)")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = args.out or Path(tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        log, run_dir = tmp / "steps.log", tmp / "resume"
        server, url = start_env_serve(tmp, env)
        # no evaluations: they replay fixed seeds (-1, i) at each eval point, which the log would count as redone
        overrides = ["run.eval_every=0", "generator.eval=false", "episode.function=null", f"episode.env_url={url}",
                     "episode.max_turns=6",
                     "episode.max_tokens=96", f"episode.options={{log: {log}, latency_s: {args.latency_s}}}",
                     *args.extra]  # fmt: skip
        cmd = [sys.executable, "-m", "asyncrl.cli", "launch", "--config", "configs/demo-guess.yaml", "--name",
               "resume", "--steps", str(args.steps), "--set", f"run.out_dir={tmp}",
               *(x for o in overrides for x in ("--set", o))]  # fmt: skip
        t0 = time.perf_counter()
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out: list[str] = []
        threading.Thread(target=lambda: out.extend(launcher.stdout), daemon=True).start()
        try:
            kills = 0
            while kills < args.kills and launcher.poll() is None:
                if len(logged_steps(log)) >= args.every * (kills + 1):
                    victim = json.loads((run_dir / "run.json").read_text())["pids"]["generator-0"]
                    os.kill(victim, signal.SIGKILL)
                    kills += 1
                    print(f"killed generator-0 (pid {victim}) at {len(logged_steps(log))} steps", flush=True)
                time.sleep(0.2)
            launcher.wait()
        finally:
            if launcher.poll() is None:
                launcher.kill()
            server.send_signal(signal.SIGTERM)
            server.wait(60)
        seconds = time.perf_counter() - t0
        steps = logged_steps(log)
        redone = len(steps) - len(set(steps))
        summary = json.loads((run_dir / "summary.json").read_text())
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mismatch = [r["learner/behaviour_logprob_mismatch"] for r in records
                if r.get("learner/behaviour_logprob_mismatch") is not None]  # fmt: skip
    probe = [r["weights/probe_logprob_diff_max"] for r in records
             if r.get("weights/probe_logprob_diff_max") is not None]  # fmt: skip
    resumed, buffer = summary["episodes_resumed"], summary["buffer"] or {}
    print("".join(out[-5:]), end="")
    print(
        f"exit {launcher.returncode} ({summary['exit_reason']}), version {summary['final_version']}/{summary['steps']} "
        f"in {seconds:.0f} s; {kills} kills, restarts {summary['restarts']}; {len(steps)} environment steps, "
        f"{redone} run twice; resumed {resumed['groups']} groups, {resumed['turns']} turns kept; "
        f"episodes failed {summary['episodes_failed']}; buffer lost {buffer.get('lost')}, unfinished "
        f"{buffer.get('unfinished')} (orphans {buffer.get('orphans')})",
        flush=True,
    )
    per_kill = max(kills, 1)
    print(f"RESULT resume_steps_redone_per_kill {redone / per_kill:.1f}")
    print(f"RESULT resume_turns_resumed_per_kill {resumed['turns'] / per_kill:.1f}")
    print(f"RESULT resume_lost {buffer.get('lost')}")
    print(f"RESULT resume_behaviour_logprob_mismatch_max {max(mismatch) if mismatch else None}")
    print(f"RESULT resume_probe_logprob_diff_max {max(probe) if probe else None}")


if __name__ == "__main__":
    main()
