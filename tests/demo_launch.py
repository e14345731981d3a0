"""The command line of a demo run, for tests that drive `asyncrl launch` as a user would, what a one-line
error of the CLI looks like, and how a test reads a run (its status, its metrics)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo-cpu.yaml"


def demo_launch_cmd(out_dir: Path, name: str, *args: str) -> list[str]:
    """``asyncrl launch`` on the demo config, writing ``out_dir/name``; ``args`` are extra flags."""
    return [sys.executable, "-m", "asyncrl.cli", "launch", "--config", "configs/demo-cpu.yaml", "--name", name,
            "--set", f"run.out_dir={out_dir}", *args]  # fmt: skip


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith("asyncrl: error: ")
    for needle in needles:
        assert needle in first, proc.stderr


def asyncrl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def status_json(run_dir: Path) -> dict | None:
    """``asyncrl status --run RUN_DIR --json``, or None while the run cannot answer yet."""
    if not (run_dir / "run.json").exists():
        return None
    out = asyncrl("status", "--run", str(run_dir), "--json")
    return json.loads(out.stdout) if out.returncode == 0 else None


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
