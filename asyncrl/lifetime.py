"""A run's processes live no longer than their launcher, and one run directory has one launch at a time.

- Every child the launcher starts (redis-server, learner ranks, generators) asks the kernel, between
  fork and exec, for SIGTERM when the launcher dies (``PR_SET_PDEATHSIG``), so ``kill -9`` of the
  launcher ends them too: redis-server flushes its AOF on SIGTERM, learners and generators leave
  whatever they had not committed, which a resumed or new run redoes. A child whose launcher died
  before the request took effect exits at once. (A generator forked by the launch's fork server asks
  once it is the launcher's child: ``asyncrl.run.forkserver``.)
- ``run.json`` names the pids of the launch that owns a run directory; a relaunch of the same
  directory refuses while any of them still runs (:func:`live_processes`).
- A :class:`Child` is one learner rank or generator as the launcher starts it (own session, log file,
  priority, CPUs); :func:`stop_processes` ends a set of them together, not one timeout after another.
- Ctrl-C and SIGTERM stop a command whatever it inherited (:func:`stop_on_signals`): a shell starts a
  background job (``cmd &``, nohup, many CI runners) with SIGINT ignored, Python then installs no
  KeyboardInterrupt handler, and an ignored signal stays ignored across exec. A command stopped by one
  exits 128 + its number: 130 after Ctrl-C, 143 after SIGTERM (:func:`stop_exit_code`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import hashlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

from asyncrl.errors import UserError
from asyncrl.rundir import pid_alive, read_run_info

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.02  # how often an ending child is looked at: an exit is seen this late at most
try:  # resolved here, in the parent: a child between fork and exec should only make the call
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: children outlive a killed launcher there
    _prctl = None


JEMALLOC_CONF = "dirty_decay_ms:2000"  # a learner's jemalloc settings (jemalloc_env)


def jemalloc_env(env: dict[str, str]) -> dict[str, str] | None:
    """``env`` with the system's jemalloc preloaded (by soname: the dynamic loader finds it as it finds any
    library), or None when the system has none. glibc's malloc keeps much of what a learner step frees;
    jemalloc gives it back (``learner.jemalloc``, measured in ``scripts/bench/memory.py``), after two seconds
    unused rather than its default ten (``MALLOC_CONF``, unless ``env`` sets one): a step frees its
    activations and allocates them again seconds later, and pages kept across that raise the peak (SmolLM2-135M
    ZeRO 0: 2.91 -> 2.84 GB at the same step time; returning them at once, 2.78 GB and steps 20% slower)."""
    import ctypes.util

    name = ctypes.util.find_library("jemalloc")
    if name is None:
        return None
    preload = " ".join(filter(None, [env.get("LD_PRELOAD"), name]))
    return {"MALLOC_CONF": JEMALLOC_CONF, **env, "LD_PRELOAD": preload}


def child_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` as every learner rank and generator of a launch has it, before the run's own (its Redis, its
    secret: the launcher's ``child_env``); the fork servers import in it (``asyncrl.run.forkserver``)."""
    env = {**environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(torch_extensions_dir()))
    return env


def torch_extensions_dir() -> Path:
    """Where JIT-built ops (DeepSpeed's CPU shm allreduce: ``asyncrl.learners.ops``) are built and cached: one
    folder per environment, and per path it is reached by. torch's build names the sources and include folders
    by that path, and ninja rebuilds (a minute) when a build's command changed: one machine-wide cache was
    rebuilt whenever another checkout's environment used it last, one per environment whenever the same
    environment was reached by another path (a symlink) than last time."""
    return Path(sys.prefix) / "torch_extensions" / hashlib.sha256(sys.prefix.encode()).hexdigest()[:8]


def learner_env(base: dict[str, str], jemalloc: bool, say: Callable[[str], None] | None = None) -> dict[str, str]:
    """The learner ranks' environment: ``base``, on jemalloc where asked (``learner.jemalloc``) and installed;
    ``say`` is told when it is asked for and missing."""
    env = jemalloc_env(base) if jemalloc else None
    if jemalloc and env is None and say is not None:
        say("learner.jemalloc: no libjemalloc.so.2 (apt install libjemalloc2); learners use glibc malloc")
    return base if env is None else env


def die_with(parent_pid: int, sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` step: the child gets ``sig`` when ``parent_pid`` (the forking thread) dies.

    Popen must be called from the launcher's main thread: the kernel watches the thread that forked.
    """

    def request() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent_pid:  # orphaned before the request: the signal will never come
            os._exit(1)

    return request


NICE_WHEN_UP_ENV = "ASYNCRL_NICE_WHEN_UP"  # a generator started at full priority lowers itself to this when up
CORES_WHEN_UP_ENV = "ASYNCRL_CORES_WHEN_UP"  # ... and pins itself to these cores ("0,1"), started on any


def pin_when_up() -> None:
    """Pin this process to the cores its launcher named in ``CORES_WHEN_UP_ENV`` (:attr:`Child.cpus_when_up`),
    if any, and drop the variable (its own children inherit the pin, not the variable)."""
    pin_threads({int(c) for c in os.environ.pop(CORES_WHEN_UP_ENV, "").split(",") if c})


def pin_threads(cores: set[int]) -> None:
    """Pin every thread of this process to ``cores`` (nothing for an empty set); threads and processes it
    starts later inherit the pin. ``os.sched_setaffinity(0, ...)`` would pin the calling thread only."""
    if not cores or not hasattr(os, "sched_setaffinity"):  # Linux only (macOS has none)
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cores)


def lower_priority(nice: int) -> None:
    """Raise this process's niceness by ``nice`` (unprivileged: only ever lower the priority). Children of
    the launcher run in their own sessions, so with autogroup scheduling (most Linux desktops and CI) CFS
    shares the CPU between sessions and a per-process nice has no effect: the session's autogroup is
    niced too."""
    if nice <= 0:
        return
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt: the same orderly stop, another exit code."""


def _terminated(signum, frame) -> NoReturn:
    raise Terminated


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_on_signals(sigterm: bool = True) -> dict:
    """From now on Ctrl-C raises KeyboardInterrupt in this process's main thread, and (``sigterm``) SIGTERM
    raises :class:`Terminated`, whatever dispositions the process inherited (SIGINT ignored, in a
    background job). Call it from the main thread, before starting children: they then inherit the
    default dispositions, not an ignored SIGINT. Returns the handlers it replaced (:func:`set_handlers`)."""
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sigterm:
        signal.signal(signal.SIGTERM, _terminated)
    return previous


def set_handlers(handlers: dict) -> None:
    """``{signal: handler}`` installed (``dict.fromkeys(STOP_SIGNALS, signal.SIG_IGN)``: a stop that must
    not be cut short by a second Ctrl-C, leaving children orphaned)."""
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def stop_exit_code(stop: KeyboardInterrupt) -> int:
    """The exit code of a command stopped by ``stop``: 143 (128 + SIGTERM) for :class:`Terminated`, else
    130 (128 + SIGINT), as a shell reports a process that a signal ended."""
    return 128 + (signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)


@contextlib.contextmanager
def starting_up():
    """A learner rank's (an offline one's too) or a generator's set-up (its lazy imports: DeepSpeed, vLLM; its
    model and engine) without the garbage collector's automatic passes, then one collection and a freeze. Each
    pass walks a heap that only grows while a process starts (~7 full passes, 0.5-1 CPU-s of a process started
    as an interpreter, with vLLM or DeepSpeed); the one at the end frees what set-up left in cycles, and the
    freeze keeps the survivors (modules, the model's objects) out of every later full pass. A process forked
    from a fork server (``asyncrl.run.forkserver``, whose imports ran with the collector off and were frozen
    without a collection) walks only what it made since the fork."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
    gc.collect()
    gc.freeze()


def exit_soon() -> None:
    """Called when a process has done its work and only returns and exits: the interpreter's last garbage
    collection then walks every object the imports made (0.6 s of a core with torch and transformers
    loaded); frozen, they are skipped. Nothing made before this call is collected afterwards."""
    gc.freeze()


def exit_after_collectives() -> NoReturn:
    """End a rank whose work is done and whose process group is destroyed, skipping the interpreter's
    finalisation: a gloo worker thread that drops its last finished work after the main thread moved on takes
    the GIL to free the work's tensors, is ended by Py_Finalize's pthread_exit inside a noexcept destructor,
    and the rank would die of SIGABRT ("terminate called without an active exception") after a good run."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclasses.dataclass
class Child:
    role: str  # "learner" | "generator"
    ident: int
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None  # or a forked one, alike (asyncrl.run.forkserver.Forked)
    incarnation: int = 0

    nice: int = 0
    cpus: set[int] | None = None  # pinned to these cores from the start
    launcher_pid: int = dataclasses.field(default_factory=os.getpid)

    # its first start at full priority, niced only once its engine is up: the first learner step waits for
    # one generator's start-up, which a niced process does only in the CPU the learners' start leaves it
    nice_when_up: bool = False
    # pinned to these cores once its engine is up (CORES_WHEN_UP_ENV): its start-up takes whichever core is free
    cpus_when_up: set[int] | None = None
    # where it is forked from when it can be (asyncrl.run.forkserver.ForkServer), instead of a fresh interpreter
    forks: object | None = None

    def _preexec(self, nice: int) -> None:
        die_with(self.launcher_pid)()
        # never an ignored Ctrl-C (a launcher started as a background job's): exec would keep it ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        lower_priority(nice)
        if self.cpus and hasattr(os, "sched_setaffinity"):  # Linux only (macOS has none)
            os.sched_setaffinity(0, self.cpus)

    def start(self) -> None:
        log = self.log_path.open("ab")
        cmd = [*self.cmd, "--incarnation", str(self.incarnation)] if self.role == "generator" else self.cmd
        env, nice = self.env, self.nice
        if self.nice_when_up and self.incarnation == 0 and nice:  # a restart starts niced: the run goes on
            env, nice = {**env, NICE_WHEN_UP_ENV: str(nice)}, 0
        if self.cpus_when_up:
            env = {**env, CORES_WHEN_UP_ENV: ",".join(map(str, sorted(self.cpus_when_up)))}
        with log:
            forked = self.forks.spawn(cmd, env, log, nice, self.cpus) if self.forks is not None else None
            self.proc = forked or subprocess.Popen(
                cmd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=functools.partial(self._preexec, nice),
            )

    @property
    def name(self) -> str:
        return f"{self.role}-{self.ident}"

    def log_tail(self, lines: int = 8) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def live_processes(run_dir: Path) -> dict[str, int]:
    """``{name: pid}`` of the processes that ``run_dir/run.json`` names and that still run: the launcher,
    redis-server and every child of the launch that owns the directory."""
    try:
        info = read_run_info(Path(run_dir))
    except UserError:  # no run there, or not one this code wrote: nobody to wait for
        return {}
    if not isinstance(info, dict):
        return {}
    named = {"launcher": info.get("launcher_pid"), "redis-server": info.get("redis_pid")}
    pids = info.get("pids")
    if isinstance(pids, dict):
        named.update(pids)
    return {
        name: pid
        for name, pid in named.items()
        if isinstance(pid, int) and pid > 0 and pid != os.getpid() and pid_alive(pid)
    }


def stop_processes(children: list, grace_s: float = 0.0, kill_after_s: float = 5.0) -> None:
    """Wait up to ``grace_s`` for children to leave on their own, then SIGTERM each one's process group
    (a child's own children go with it), all at once, and SIGKILL the groups of those still there
    ``kill_after_s`` later."""
    live = [c for c in children if c.proc is not None]
    wait_processes(live, grace_s)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        running = [c for c in live if c.proc.poll() is None]
        signal_processes(running, sig)
        wait_processes(running, kill_after_s)


def signal_processes(children: list, sig: int) -> None:
    """Send ``sig`` to the process group of each child that still runs."""
    for c in children:
        if c.proc is not None and c.proc.poll() is None:
            try:
                os.killpg(c.proc.pid, sig)
            except ProcessLookupError:
                pass


def wait_processes(children: list, timeout_s: float) -> bool:
    """Wait until every child has exited (reaping it) or ``timeout_s`` passed; whether all did."""
    deadline = time.monotonic() + timeout_s
    while any(c.proc.poll() is None for c in children):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True
