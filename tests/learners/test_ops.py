"""DeepSpeed's JIT-built CPU op: a lock file left by a killed build never blocks a start, a build that is still
running is waited for (and said), and two of our builders never build at once, even when one is killed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from asyncrl.learners import ops


def _in_thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def _wait(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_lock_file_with_no_builder_is_removed(tmp_path):
    build = tmp_path / "deepspeed_shm_comm"
    build.mkdir()
    (build / "lock").touch()
    said: list[str] = []
    ops.clear_stale_lock(build, said.append)
    assert not (build / "lock").exists() and said == []


def test_a_lock_file_whose_build_runs_is_waited_for_and_said(tmp_path):
    """A process working in the build directory (torch runs ninja and the compiler there) holds its lock file:
    the rank says what it waits for and waits; once that process is gone, the file it left goes too."""
    build = tmp_path / "deepspeed_shm_comm"
    build.mkdir()
    (build / "lock").touch()
    builder = subprocess.Popen(["sleep", "60"], cwd=build)
    try:
        _wait(lambda: builder.pid in ops.working_in(build))
        said: list[str] = []
        waiter = _in_thread(ops.clear_stale_lock, build, said.append)
        _wait(lambda: said)
        assert said == [f"waiting for {build / 'lock'}: a build that is not this run's works in {build}"]
        waiter.join(2 * ops.WAIT_POLL_S)
        assert waiter.is_alive() and (build / "lock").exists()
    finally:
        builder.kill()
        builder.wait()
    waiter.join(30)
    assert not waiter.is_alive() and not (build / "lock").exists()


HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(120)
"""


def test_the_build_lock_dies_with_its_holder(tmp_path):
    """A builder killed with SIGKILL (no handler runs) leaves no lock behind: the next one goes on at once."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / ops.LOCK_NAME)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        said: list[str] = []
        entered = threading.Event()

        def take() -> None:
            with ops.build_lock(tmp_path, said.append):
                entered.set()

        taker = _in_thread(take)
        _wait(lambda: said)
        assert said == [f"waiting for another process's build in {tmp_path} ({ops.LOCK_NAME})"]
        assert not entered.wait(0.5)
    finally:
        holder.kill()
        holder.wait()
    assert entered.wait(30)
    taker.join(30)


def test_the_op_loads_from_the_environments_cache_past_a_stale_lock(tmp_path, monkeypatch):
    """The op ``scripts/setup.sh`` built, copied with a lock file a killed build left: it loads (no rebuild:
    ninja finds the copy up to date) and the lock file is gone."""
    import shutil

    from asyncrl.lifetime import torch_extensions_dir

    built = torch_extensions_dir() / "deepspeed_shm_comm"
    assert (built / "deepspeed_shm_comm.so").is_file(), "scripts/setup.sh builds the op"
    shutil.copytree(built, tmp_path / "deepspeed_shm_comm")
    (tmp_path / "deepspeed_shm_comm" / "lock").touch()
    code = (
        "import os; os.environ['DS_ACCELERATOR'] = 'cpu'\n"
        "from asyncrl.learners.ops import load_cpu_op\n"
        "said = []\n"
        "assert load_cpu_op(said.append) is not None\n"
        "print(said)\n"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "loading DeepSpeed's deepspeed_shm_comm op" in out.stdout, out.stdout
    assert "removing" in out.stderr and "left by a build that was killed" in out.stderr
    assert not (tmp_path / "deepspeed_shm_comm" / "lock").exists()
