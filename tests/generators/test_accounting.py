"""The generator's own accounting of threads and child processes (``generator/threads``,
``generator/child_processes``): real processes and threads, counted as the kernel sees them."""

from __future__ import annotations

import subprocess
import sys
import threading

from asyncrl.generators.accounting import children_by_scan, threads_and_children


def test_children_started_from_any_thread_are_counted_and_a_zombie_is_not():
    _, before = threads_and_children()
    others = set(children_by_scan())  # another test's servers, if any
    sleepers: list[subprocess.Popen] = []
    release = threading.Event()

    def start_one() -> None:  # a child of this thread, which then stays alive
        sleepers.append(subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE))
        release.wait(30)

    helper = threading.Thread(target=start_one)
    helper.start()
    sleepers.append(subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE))
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        while len(sleepers) < 2:
            threading.Event().wait(0.01)
        while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            threading.Event().wait(0.01)  # exited, not yet reaped
        threads, children = threads_and_children()
        assert children == before + 2  # the zombie is not counted
        assert threads >= 2  # this one and the helper
        assert set(children_by_scan()) - others == {p.pid for p in sleepers}  # the fallback agrees
    finally:
        release.set()
        helper.join()
        for p in sleepers:
            p.stdin.close()
            p.wait(30)
        zombie.wait(30)
    assert threads_and_children()[1] == before
