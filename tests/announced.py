"""A server started as a command (``asyncrl env-serve``, ``agent-serve``, ...): its output read on a thread, and the
URL its ready line announces (``asyncrl <command>: ... at http://host:port ...``)."""

from __future__ import annotations

import queue
import subprocess
import threading
import time


class Output:
    """Every line a process printed, as it prints them."""

    def __init__(self):
        self.lines: list[str] = []
        self.ended = threading.Event()

    def text(self, timeout_s: float = 30.0) -> str:
        """All of it, once its output has ended (the process exited); what came within ``timeout_s`` otherwise."""
        self.ended.wait(timeout_s)
        return "\n".join(self.lines)


def announced_url(proc: subprocess.Popen, what: str, timeout_s: float) -> tuple[str, Output]:
    """``(url, output)`` once ``proc`` (text stdout, stderr merged into it) prints its URL. Fails the test if it
    exits first, or does not print it within ``timeout_s``."""
    output, ready = Output(), queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            output.lines.append(line.rstrip("\n"))
            ready.put(output.lines[-1])
        output.ended.set()
        ready.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        line = ready.get(timeout=max(0.1, deadline - time.monotonic()))
        assert line is not None, f"{what} exited ({proc.wait()}):\n" + "\n".join(output.lines)
        if " at http://" in line:
            return line.split(" at ", 1)[1].split()[0], output
