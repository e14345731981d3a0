"""The command line of a demo run, for tests that drive `asyncrl launch` as a user would."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def demo_launch_cmd(out_dir: Path, name: str, *args: str) -> list[str]:
    """``asyncrl launch`` on the demo config, writing ``out_dir/name``; ``args`` are extra flags."""
    return [sys.executable, "-m", "asyncrl.cli", "launch", "--config", "configs/demo-cpu.yaml", "--name", name,
            "--set", f"run.out_dir={out_dir}", *args]  # fmt: skip
