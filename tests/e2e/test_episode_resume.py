"""Episodes outlive their generator, in a real run: ``scripts/bench/resume.py`` launches the guess demo with
episodes of up to 6 turns whose environment (1 s a step) lives in ``asyncrl env-serve``, and SIGKILLs
generator-0 once the environment has run 64 steps, mid-episode. The dead generator's groups are resumed
from their journals by the generators left (the restart or the other one).

What decides it: the run completes with every group accounted for (none lost, none unfinished); groups and
turns were resumed; the environment's own log shows no step run twice for one episode; and the engines'
log-probs match the learner's (the weight-sync probe of every version, and the learner's same-version
mismatch).
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import pytest
from demo_launch import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]

STEPS = 3


def results(output: str) -> dict[str, str]:
    return dict(line.split()[1:3] for line in output.splitlines() if line.startswith("RESULT "))


def test_a_killed_generators_episodes_resume_from_their_last_turn(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    cmd = [sys.executable, "scripts/bench/resume.py", "--kills", "1", "--every", "64", "--steps", str(STEPS),
           "--out", str(tmp_path)]  # fmt: skip
    bench = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    summary = json.loads((tmp_path / "resume" / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["final_version"] == STEPS, summary
    assert summary["restarts"]["generators"] == 1 and summary["episodes_failed"] == {}, summary
    buffer = summary["buffer"]
    assert buffer["lost"] == 0 and buffer["unfinished"] == 0 and buffer["orphans"] == 0, buffer
    assert buffer["resumed"] >= 1 and summary["episodes_resumed"]["groups"] == buffer["resumed"], summary
    assert summary["episodes_resumed"]["turns"] >= 1, summary["episodes_resumed"]
    steps = collections.Counter(
        tuple(line.split(" ", 2)[:2]) for line in (tmp_path / "steps.log").read_text().splitlines()
    )
    assert [key for key, n in steps.items() if n > 1] == [], "an environment step was run twice"
    figures = results(bench.stdout)
    assert figures["resume_lost"] == "0" and figures["resume_steps_redone_per_kill"] == "0.0", figures
    assert float(figures["resume_probe_logprob_diff_max"]) < 1e-3, figures
    assert float(figures["resume_behaviour_logprob_mismatch_max"]) < 1e-3, figures
