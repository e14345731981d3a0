"""The launcher's children, on real processes (fast: no Redis, no engine): how it reads their exits, and the
allocator its learner ranks run on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from demo_launch import DEMO

from asyncrl.config import load_config
from asyncrl.errors import UserError
from asyncrl.lifetime import JEMALLOC_CONF, Child, jemalloc_env, learner_env
from asyncrl.run.launch import Launcher, core_plan


def _exited(tmp_path, role: str, ident: int, code: str) -> Child:
    """A child that has ended: with ``sys.exit(code)``, or killed by itself with SIGKILL (``"kill"``)."""
    body = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)" if code == "kill" else f"raise SystemExit({code})"
    child = Child(role, ident, [sys.executable, "-c", body], {}, tmp_path / f"{role}-{ident}.log")
    child.start()
    child.proc.wait()
    return child


@pytest.mark.parametrize("killed", [0, 1])
def test_a_dead_learner_is_named_by_the_signal_that_killed_it_not_by_the_ranks_that_followed(tmp_path, killed):
    """SIGKILL one rank and the other fails its collective with exit 1 before the launcher's next poll:
    the error names the killed rank, whichever rank it was."""
    cfg = load_config(DEMO, {"run.out_dir": str(tmp_path), "learner.max_restarts": 0})
    launcher = Launcher(cfg)
    launcher.children = [_exited(tmp_path, "learner", r, "kill" if r == killed else "1") for r in (0, 1)]
    with pytest.raises(UserError, match=f"^learner-{killed} exited with code -9"):
        launcher.check_children(control=None)


def _maps_of_child(env: dict[str, str]) -> str:
    code = "print(open('/proc/self/maps').read())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_launched_learners_run_on_jemalloc_unless_told_not_to(tmp_path):
    """scripts/setup.sh installs libjemalloc2; a learner's environment preloads it (after any LD_PRELOAD
    of the user's), and the process really runs on it."""
    base = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": ""}
    cfg = load_config(DEMO, {"run.out_dir": str(tmp_path)})
    env = learner_env(base, cfg.learner.jemalloc)
    assert env is not base and "jemalloc" in env["LD_PRELOAD"], "no libjemalloc.so.2: run scripts/setup.sh"
    assert "jemalloc" in _maps_of_child(env)
    assert "jemalloc" not in _maps_of_child(base)
    assert jemalloc_env({"LD_PRELOAD": "/opt/mine.so"})["LD_PRELOAD"].startswith("/opt/mine.so ")
    assert env["MALLOC_CONF"] == JEMALLOC_CONF  # jemalloc takes it: an unknown option is a warning on stderr
    assert "<jemalloc>" not in subprocess.run(["true"], env=env, capture_output=True, text=True, check=True).stderr
    bad = subprocess.run(["true"], env={**env, "MALLOC_CONF": "no_such:1"}, capture_output=True, text=True)
    assert "<jemalloc>" in bad.stderr  # the check above can fail
    assert jemalloc_env({"MALLOC_CONF": "narenas:1"})["MALLOC_CONF"] == "narenas:1"  # the user's wins
    off = load_config(DEMO, {"run.out_dir": str(tmp_path), "learner.jemalloc": False})
    assert learner_env(base, off.learner.jemalloc) is base


def test_without_jemalloc_learners_keep_the_system_malloc_and_the_launcher_says_so(tmp_path, monkeypatch):
    import ctypes.util

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    said = []
    base = {"PATH": "/usr/bin:/bin"}
    assert learner_env(base, load_config(DEMO, {"run.out_dir": str(tmp_path)}).learner.jemalloc, said.append) is base
    assert len(said) == 1 and "apt install libjemalloc2" in said[0]


def test_each_generator_is_started_on_its_own_gpu_after_the_learners(tmp_path, monkeypatch):
    """spawn hands each generator its GPU of the plan (asyncrl/run/gpus.py) as CUDA_VISIBLE_DEVICES; learner
    ranks keep every GPU (they take theirs by LOCAL_RANK)."""
    from asyncrl.run import launch

    monkeypatch.setattr(launch, "visible_gpus", lambda: ["0", "1", "2"])
    monkeypatch.setattr(Child, "start", lambda self: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = load_config(DEMO, {"run.out_dir": str(tmp_path), "run.learners": 1, "run.generators": 3})
    launcher = Launcher(cfg)
    launcher.gpus = launcher.place_gpus()
    launcher.spawn(tmp_path / "config.yaml", "redis://127.0.0.1:1/0", "prefix")
    placed = {c.name: c.env.get("CUDA_VISIBLE_DEVICES") for c in launcher.children}
    assert placed == {"learner-0": None, "generator-0": "1", "generator-1": "2", "generator-2": "1"}
    assert launcher.children[0].env["LOCAL_RANK"] == "0"


def test_core_plan_puts_ranks_first_then_generators_round_the_cores():
    assert core_plan([0, 1], 2, 2) == ([0, 1], [0, 1])  # the demo on 2 cores: rank r and generator r share core r
    assert core_plan([0, 1], 1, 1) == ([0], [1])  # one each: a core each
    assert core_plan([2, 5, 7], 1, 3) == ([2], [5, 7, 2])  # the launcher's own cores (taskset), round again
    assert core_plan([0, 1, 2, 3], 0, 2) == ([], [0, 1])  # every rank on other hosts


def test_spawn_pins_each_child_to_its_core_and_a_real_generator_pins_every_thread(tmp_path, monkeypatch):
    """Under run.cpu_scheduling (no GPU driver) every learner rank is pinned to its core of the plan from the
    start, every generator once its engine is up (CORES_WHEN_UP_ENV; vLLM's OpenMP binding told the same
    core); a child given its cores that way pins all its threads, those started before too."""
    from asyncrl.run import launch

    started = []
    monkeypatch.setattr(launch, "has_driver", lambda: False)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(Child, "start", lambda self: started.append(self))
    cfg = load_config(DEMO, {"run.out_dir": str(tmp_path), "run.learners": 1, "run.generators": 2})
    launcher = Launcher(cfg)
    launcher.gpus = launcher.place_gpus()
    launcher.spawn(tmp_path / "config.yaml", "redis://127.0.0.1:1/0", "prefix")
    assert [(c.name, c.cpus, c.cpus_when_up) for c in started] == [
        ("learner-0", {0}, None), ("generator-0", None, {1}), ("generator-1", None, {0})
    ]  # fmt: skip
    assert [c.env["VLLM_CPU_OMP_THREADS_BIND"] for c in started[1:]] == ["1", "0"]
    off = Launcher(load_config(DEMO, {"run.out_dir": str(tmp_path), "run.cpu_scheduling": False}))
    off.gpus = off.place_gpus()
    started.clear()
    off.spawn(tmp_path / "config.yaml", "redis://127.0.0.1:1/0", "prefix")
    assert all(c.cpus is None and c.cpus_when_up is None for c in started)

    monkeypatch.undo()
    core = max(os.sched_getaffinity(0))
    code = (
        "import os, threading; from asyncrl.lifetime import pin_when_up; "
        "e = threading.Event(); t = threading.Thread(target=e.wait); t.start(); "
        "print(len(os.sched_getaffinity(0))); "
        "pin_when_up(); "
        "print(sorted({c for tid in os.listdir('/proc/self/task') for c in os.sched_getaffinity(int(tid))})); e.set()"
    )
    child = Child("generator", 0, [sys.executable, "-c", code], dict(os.environ), tmp_path / "pinned.log")
    child.cpus_when_up = {core}
    child.start()
    assert child.proc.wait() == 0, (tmp_path / "pinned.log").read_text()
    assert (tmp_path / "pinned.log").read_text().split() == [str(len(os.sched_getaffinity(0))), f"[{core}]"]
