"""The end-to-end tests' shared launch: one demo run that every test reading a demo run uses.

Start-up costs a launch about 15 s of two cores, so the tests that only watch or read a run (status while
it runs and after it ends, metrics, TensorBoard, plots, the export) share one: :func:`demo_run` starts it
once per session, takes the live snapshots while it runs, and hands the finished run to each test.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from pathlib import Path

import pytest
from demo_launch import ROOT, demo_launch_cmd, read_metrics, status_json


@dataclasses.dataclass(frozen=True)
class DemoRun:
    run_dir: Path
    returncode: int
    output: str  # the launcher's stdout and stderr
    live: dict  # `asyncrl status --json` once learner version 2 was reached, both generators registered
    summary: dict
    metrics: list[dict]


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """The README's demo asynchronously: 2 generators, 2 learners, lag 2, its 40 steps. Watched with
    ``asyncrl status`` until version 2 with both generators registered (40 steps leave the watcher tens of
    seconds to see that), then waited for to the end."""
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    out_dir = tmp_path_factory.mktemp("demo-run")
    run_dir = out_dir / "e2e-async"
    # cpu_scheduling off: no generator niced, so under a loaded CI machine both are up (and seen by the
    # watcher) within the run's first versions; niced, generator 1 once came up after version 20 of 40
    cmd = demo_launch_cmd(out_dir, "e2e-async", "--generators", "2", "--learners", "2", "--max-policy-lag", "2",
                          "--set", "run.cpu_scheduling=false")  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not ((live := status_json(run_dir)) and live["version"] >= 2 and len(live["generators"]) == 2):
            assert proc.poll() is None, f"the launcher exited ({proc.returncode}) before its live status was seen"
            assert time.monotonic() < deadline, "no learner version 2 with both generators in 600 s"
            time.sleep(0.5)
        output, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    metrics = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    return DemoRun(run_dir, proc.returncode, output, live, summary, metrics)
