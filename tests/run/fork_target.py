"""What a forked child sees of itself, written as JSON to ``argv[1]``; then it exits with ``argv[2]``
(an int), or waits for a signal (``wait``). Run by tests/run/test_forkserver.py through a fork server."""

import gc
import json
import os
import signal
import sys

path, then = sys.argv[1], sys.argv[2]
report = {
    "argv": sys.argv[1:],
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "sid": os.getsid(0),
    "pgid": os.getpgid(0),
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "nice": os.nice(0),
    "cpus": sorted(os.sched_getaffinity(0)),
    "stdin": os.readlink("/proc/self/fd/0"),
    "preloaded": "fork_preload" in sys.modules,
    "gc": [gc.isenabled(), gc.get_freeze_count() > 0],
    "sigint": str(signal.getsignal(signal.SIGINT)),
    "sigterm": str(signal.getsignal(signal.SIGTERM)),
    "main": __name__,
    "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\0").replace(b"\0", b" ").decode(),
}
print("to the log: stdout", flush=True)
print("to the log: stderr", file=sys.stderr, flush=True)
with open(path + ".tmp", "w") as f:
    json.dump(report, f)
os.replace(path + ".tmp", path)
if then == "wait":
    signal.pause()
sys.exit(int(then))
