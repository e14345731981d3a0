"""Every algorithm preset learns the demo task in a tiny run through the CLI.

One generator (the transformers engine: it starts in seconds, where vLLM takes most of a minute), one
learner, STEPS steps, each preset with its own defaults (the demo config's KL / aggregation overrides
are reset to the preset's). Prints a table: preset, initial and final greedy eval reward, wall seconds.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from demo_launch import ROOT, demo_launch_cmd

from asyncrl.config.presets import PRESETS

pytestmark = [pytest.mark.slow, pytest.mark.redis]

STEPS = 6  # the demo's GRPO goes 0.22 -> ~0.85 in 6 steps; startup dominates the wall time
MARGIN = 0.15  # "clearly above": the eval reward starts at 0.22 and moves < 0.02 without learning
RESULTS: dict[str, tuple[float, float, float]] = {}


def preset_cmd(out_dir: Path, preset: str, steps: int = STEPS, *extra: str) -> list[str]:
    """The demo launch with ``algorithm.name=preset`` and the preset's own defaults."""
    sets = [
        f"algorithm.name={preset}",
        "algorithm.kl_coef=null",
        "algorithm.aggregation=null",
        "generator.engine.type=hf",
        "run.eval_every=0",
    ]
    args = ["--generators", "1", "--learners", "1", "--steps", str(steps), *extra]
    return demo_launch_cmd(out_dir, preset, *args, *[x for s in sets for x in ("--set", s)])


@pytest.fixture(scope="module", autouse=True)
def table(request):
    yield
    lines = ["", "| preset | initial eval | final eval | wall s |", "|---|---|---|---|"]
    lines += [f"| {n} | {a:.3f} | {b:.3f} | {w:.0f} |" for n, (a, b, w) in sorted(RESULTS.items())]
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n".join(lines), flush=True)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_learns_the_demo(tmp_path, preset):
    t0 = time.monotonic()
    proc = subprocess.run(preset_cmd(tmp_path, preset), cwd=ROOT, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / preset / "summary.json").read_text())
    before, after = summary["initial_eval_reward"], summary["final_eval_reward"]
    RESULTS[preset] = (before, after, wall)
    assert summary["final_version"] == STEPS
    assert after > before + MARGIN, (preset, before, after)
    if PRESETS[preset].needs_critic:  # the critic is checkpointed with the policy
        assert (tmp_path / preset / "checkpoint" / f"version-{STEPS}" / "critic").is_dir()
