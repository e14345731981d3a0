"""An agent program per episode (``episode.agent_command``) and an agent service (``asyncrl agent-serve``,
``episode.agent_url``) against the same agent in process (``episode.agent``): the guess demo
(configs/demo-guess-agent.yaml) launched each way, alternated, ``--rounds`` each. The program is
scripts/agents/guess_cli.py (the synchronous ``openai`` client, its reward POSTed), at most ``--processes`` at
once (``episode.agent_processes``); the service runs ``asyncrl.demo.guess_agent:play``, the in-process agent's
function, on loopback, started by the bench for each run. Prints each run's samples/s, its final eval, the
generators' peak child processes and the host's peak 1-minute load average, and the median ratios:

    .venv/bin/python scripts/bench/agent_command.py --steps 20 --rounds 2 --ways inprocess,service,command
    RESULT service_over_inprocess_samples_per_s <x>
    RESULT command_over_inprocess_samples_per_s <x>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = f"{sys.executable} scripts/agents/guess_cli.py"
AGENT = "asyncrl.demo.guess_agent:play"


def launch(out: Path, name: str, steps: int, extra: list[str], service: bool = False) -> dict:
    """One run (``service``: with an ``asyncrl agent-serve`` of the guess agent, stopped after it); its summary
    with the host's peak load average while it ran."""
    if service:
        serving = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "agent-serve", "--agent", AGENT,
                                    "--token-file", str(out / f"{name}.token")],  # fmt: skip
                                   cwd=ROOT, stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            url = serving.stdout.readline().split(" at ", 1)[1].split()[0]
            token = (out / f"{name}.token").read_text().strip()
            url = url.replace("http://", f"http://:{token}@", 1)
            return launch(out, name, steps, [*extra, "--set", f"episode.agent_url={url}"])
        finally:
            serving.terminate()
            serving.wait(60)
    cmd = [sys.executable, "-m", "asyncrl.cli", "launch", "--config", "configs/demo-guess-agent.yaml",
           "--name", name, "--steps", str(steps), "--set", f"run.out_dir={out}", *extra]  # fmt: skip
    peak, done = [0.0], threading.Event()

    def watch() -> None:
        while not done.wait(1.0):
            peak[0] = max(peak[0], os.getloadavg()[0])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    done.set()
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stderr[-2000:]}")
    summary = json.loads((out / name / "summary.json").read_text())
    return summary | {"wall_s": time.monotonic() - started, "load_peak": peak[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--processes", type=int, default=None, help="episode.agent_processes (default: its own)")
    parser.add_argument("--ways", default="inprocess,command", help="of inprocess, service, command (comma-separated)")
    args = parser.parse_args()
    command = ["--set", "episode.type=agent_command", "--set", f"episode.agent_command={PROGRAM}",
               "--set", "episode.agent=null"]  # fmt: skip
    if args.processes is not None:
        command += ["--set", f"episode.agent_processes={args.processes}"]
    every = {"inprocess": [], "service": ["--set", "episode.agent=null"], "command": command}
    ways = {way: every[way] for way in args.ways.split(",")}
    if "inprocess" not in ways or len(ways) < 2:
        parser.error("--ways: inprocess and at least one other, to compare")
    rates: dict[str, list[float]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for way, extra in ways.items():
                s = launch(Path(tmp), f"{way}-{r}", args.steps, extra, service=way == "service")
                rates[way].append(s["samples_per_s"])
                children = s.get("generator_peaks", {}).get("child_processes")
                print(f"{way} round {r}: {s['samples_per_s']:.1f} samples/s, eval {s['initial_eval_reward']} -> "
                      f"{s['final_eval_reward']}, peak children {children}, peak load {s['load_peak']:.1f}, "
                      f"wall {s['wall_s']:.0f}s, failed {s.get('episodes_failed')}", flush=True)  # fmt: skip
    for way in [way for way in ways if way != "inprocess"]:
        ratio = statistics.median(rates[way]) / statistics.median(rates["inprocess"])
        print(f"RESULT {way}_over_inprocess_samples_per_s {ratio:.3f}")


if __name__ == "__main__":
    main()
