"""The generators' fork server (asyncrl.run.forkserver), on real processes without an engine: a forked child is
what the launcher would have started (its child, own session, environment, descriptors, priority, cores,
signals, exit code), dies with its launcher, and where the server cannot serve the child starts otherwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asyncrl.lifetime import Child
from asyncrl.run import forkserver
from asyncrl.run.forkserver import Forked, ForkServer
from asyncrl.rundir import pid_alive

pytestmark = pytest.mark.skipif(not forkserver.available(), reason="fork servers are Linux-only")

HERE = Path(__file__).parent
TARGET = [sys.executable, "-m", "fork_target"]


def server(tmp_path: Path, preload=("fork_preload",), said=None) -> ForkServer:
    env = dict(os.environ, PYTHONPATH=str(HERE), ONLY_THE_SERVERS="1")
    s = ForkServer(list(preload), env, tmp_path / "forkserver.log", say=(said if said is not None else []).append)
    s.start()
    return s


def wait_for(path: Path, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return json.loads(path.read_text())


def test_a_forked_child_is_what_the_launcher_would_have_started(tmp_path):
    s = server(tmp_path)
    try:
        log = tmp_path / "child.log"
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(HERE), "MINE": "yes"}
        cpus = {sorted(os.sched_getaffinity(0))[-1]}
        with log.open("ab") as f:
            child = s.spawn([*TARGET, str(tmp_path / "report.json"), "7"], env, f, 3, cpus)
        assert isinstance(child, Forked)
        assert child.wait(60) == 7 and child.poll() == 7
        r = json.loads((tmp_path / "report.json").read_text())
    finally:
        s.close()
    assert r["argv"] == [str(tmp_path / "report.json"), "7"] and r["main"] == "__main__"
    assert r["ppid"] == os.getpid(), "the launcher's own child: it waits for it and reads its exit code"
    assert r["sid"] == r["pgid"] == r["pid"], "its own session and process group, as start_new_session gives"
    assert r["env"].get("MINE") == "yes" and "ONLY_THE_SERVERS" not in r["env"], "its environment, not the server's"
    assert r["cwd"] == os.getcwd() and r["stdin"] == "/dev/null"
    assert r["nice"] == os.nice(0) + 3 and r["cpus"] == sorted(cpus)
    assert r["preloaded"], "the server's imports are the child's"
    assert r["gc"] == [True, True], "collections on (the server imports without them), the imports frozen"
    assert r["sigint"] == str(signal.default_int_handler) and r["sigterm"] == str(signal.SIG_DFL)
    assert "to the log: stdout" in log.read_text() and "to the log: stderr" in log.read_text()
    assert r["cmdline"].startswith(f"{sys.executable} -m fork_target /"), "ps shows what it runs (cut to fit)"


def test_a_module_the_server_imported_runs_its_main_not_a_second_copy(tmp_path):
    """The generators' own module is among the server's imports: its child calls its main(); runpy would
    execute the module again as __main__ (two of every class and global) and warn in the generator's log."""
    record = tmp_path / "record.txt"
    env = dict(os.environ, PYTHONPATH=str(HERE), FORK_MAIN_RECORD=str(record))
    s = ForkServer(["fork_main_target"], env, tmp_path / "forkserver.log")
    s.start()
    try:
        log = tmp_path / "child.log"
        with log.open("ab") as f:
            child = s.spawn([sys.executable, "-m", "fork_main_target", "a", "b"], env, f, 0, set())
        assert isinstance(child, Forked) and child.wait(60) == 0
    finally:
        s.close()
    assert record.read_text().splitlines() == ["executed as fork_main_target", "main a b"]
    assert log.read_text() == "", "nothing in the child's log (no runpy RuntimeWarning)"


def test_a_signal_ends_a_forked_child_as_it_ends_a_started_one(tmp_path):
    """Child.start forks where it has a server; stop's SIGTERM to the process group reads as -15."""
    s = server(tmp_path)
    try:
        report = tmp_path / "report.json"
        child = Child("generator", 0, [*TARGET, str(report), "wait"], dict(os.environ), tmp_path / "g.log", forks=s)
        child.start()
        assert isinstance(child.proc, Forked)
        wait_for(report)
        assert child.proc.poll() is None
        os.killpg(child.proc.pid, signal.SIGTERM)
        assert child.proc.wait(30) == -signal.SIGTERM
        child.incarnation += 1  # a restart forks again: a new pid, the server still serving
        report.unlink()
        child.start()
        assert isinstance(child.proc, Forked) and wait_for(report)["pid"] == child.proc.pid
        child.proc.kill()
        assert child.proc.wait(30) == -signal.SIGKILL
    finally:
        s.close()


LAUNCHER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from asyncrl.run.forkserver import ForkServer
    tmp = Path(sys.argv[1])
    env = dict(os.environ, PYTHONPATH=sys.argv[2])
    s = ForkServer(["fork_preload"], env, tmp / "forkserver.log")
    s.start()
    with (tmp / "child.log").open("ab") as f:
        child = s.spawn([sys.executable, "-m", "fork_target", str(tmp / "report.json"), "wait"], env, f, 0, None)
    print(child.pid, s.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_forked_child_and_the_server_die_with_their_launcher(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), str(HERE)], stdout=subprocess.PIPE, text=True
    )
    try:
        child, served_by = map(int, launcher.stdout.readline().split())
        assert wait_for(tmp_path / "report.json")["ppid"] == launcher.pid
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while pid_alive(child) or pid_alive(served_by):
            assert time.monotonic() < deadline, "a forked child or its server outlived the launcher's kill -9"
            time.sleep(0.05)
    finally:
        for pid in (launcher.pid,):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_without_a_server_the_child_starts_as_its_own_interpreter(tmp_path):
    """A server whose imports fail, or that died: one line says so, and every child starts anyway."""
    said: list[str] = []
    broken = server(tmp_path, preload=("no_such_module_here",), said=said)
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(HERE))
    child = Child("generator", 0, [*TARGET, str(report), "5"], env, tmp_path / "g.log", forks=broken)
    child.start()
    assert isinstance(child.proc, subprocess.Popen) and child.proc.wait(60) == 5
    assert len(said) == 1 and "no_such_module_here" not in said[0] and "forkserver.log" in said[0]
    assert "No module named 'no_such_module_here'" in (tmp_path / "forkserver.log").read_text()
    assert broken.pid is None
    child.start()  # the next start goes straight to an interpreter, nothing said again
    assert isinstance(child.proc, subprocess.Popen) and child.proc.wait(60) == 5 and len(said) == 1

    killed = server(tmp_path, said=said)
    os.kill(killed.proc.pid, signal.SIGKILL)
    killed.proc.wait()
    child.forks = killed
    child.start()
    assert isinstance(child.proc, subprocess.Popen) and child.proc.wait(60) == 5 and len(said) == 2


def test_what_the_learners_server_imports_starts_no_python_thread_and_hides_triton():
    """The CPU learners' server imports what a rank would (DeepSpeed, transformers' model classes) as the rank
    would: triton hidden first, no thread, no CUDA."""
    code = "import sys, threading, torch\nimport asyncrl.learners.preload\n"
    code += "print(threading.active_count(), sys.modules['triton'], 'deepspeed' in sys.modules, "
    code += "torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split()[-4:] == ["1", "None", "True", "False"], out.stdout + out.stderr


def test_learner_ranks_are_forked_on_cpu_only_and_when_asked(tmp_path):
    """The cases that start no learners' server (a started one is the launch tests')."""
    from asyncrl.config import load_config
    from asyncrl.run.forkserver import learners_fork_server

    assert learners_fork_server(load_config(None, {}), True, tmp_path, print) is None, "ranks on GPUs are started"
    off = load_config(None, {"run.fork_learners": False})
    assert learners_fork_server(off, False, tmp_path, print) is None


@pytest.mark.vllm
def test_what_the_generators_server_imports_starts_no_python_thread():
    """A thread running in the server at a fork would be missing in the child with whatever lock it held."""
    pytest.importorskip("vllm")
    from asyncrl.config import VllmEngineConfig
    from asyncrl.generators.engine import preload_modules

    modules = preload_modules(VllmEngineConfig(), gpu=False)
    code = f"import importlib, threading\nfor m in {modules!r}: importlib.import_module(m)\n"
    code += "print(threading.active_count())"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split()[-1] == "1", out.stdout + out.stderr
