"""Generators forked from one process that imported their modules once (``run.fork_generators``); on CPU the
local learner ranks from another (``run.fork_learners``, :func:`learners_fork_server`).

A generator's interpreter spends most of its start-up importing torch, transformers and vLLM (6.6 CPU-s
of the ~7.7 to a serving engine on the demo, this machine): paid by every generator at every start and
restart, on the cores the learners start on. The launcher starts one fork server first; it imports the
modules it is given (``asyncrl.generators.engine.preload_modules``) and nothing else: no thread of its
own, no engine, no CUDA. It then forks each generator the launcher asks for, which runs its module as
``python -m`` would; a module the server imported (``asyncrl.generators.worker``) runs its ``main()``, not a
second copy of itself as ``__main__``.

Supervision stays the launcher's. The server forks twice and the middle process exits at once, so the
generator is re-parented to the launcher (``PR_SET_CHILD_SUBREAPER``, set only while a fork is in flight):
the launcher waits for it, signals its process group and reads its exit code as for any child
(:class:`Forked` is what :class:`asyncrl.lifetime.Child` uses of ``subprocess.Popen``). A forked
generator gets what a started one gets: its own session, SIGTERM when the launcher dies
(``PR_SET_PDEATHSIG``, asked once it is the launcher's child), its environment (replacing the server's),
working directory, log file as stdout and stderr, priority and cores; numpy's global seed is drawn again
(Python's ``random`` is reseeded by the interpreter at every fork).

Linux only. Where the server cannot start, import or fork, or has died, a generator starts as its own
interpreter instead (said once in the launcher's log): a slower start, never a lost one.

Wire: a SOCK_SEQPACKET socket pair, JSON, one message each way per fork; the log file's descriptor rides
with the request (SCM_RIGHTS). The server says ``{"ready": true}`` once its imports are done; the launcher
sends ``{"module", "argv", "env", "cwd", "nice", "cpus", "parent"}``; the server answers ``{"pid": n}``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.lifetime import child_env, die_with, learner_env, lower_priority

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.run.gpus import GpuPlan

MAX_MESSAGE = 1 << 20  # a request: its environment, mostly
READY_TIMEOUT_S = 300.0  # the server's imports (a cold disk: 20 s here) before a generator starts otherwise
FORK_TIMEOUT_S = 30.0  # one fork, answered
REPARENT_TIMEOUT_S = 10.0  # a forked generator waits this long at most to become the launcher's child
_PR_SET_CHILD_SUBREAPER = 36


def available() -> bool:
    """Whether this platform can fork generators for the launcher (Linux's subreapers)."""
    return sys.platform.startswith("linux") and hasattr(socket, "send_fds")


# -- the launcher's side ---------------------------------------------------------------------------
def generators_fork_server(cfg: Config, gpu: bool, logs: Path, say: Callable[[str], None]) -> ForkServer | None:
    """A launch's fork server for its generators, started (it imports while the rest of the run starts), or
    None where ``run.fork_generators`` is off, no generator is local or the platform has no subreapers."""
    if not (cfg.run.fork_generators and cfg.run.generators and available()):
        return None
    from asyncrl.fleet.rendezvous import engine_env
    from asyncrl.generators.engine import preload_modules

    # what the imports may read of the environment, as every generator has it (its own replaces it after the fork)
    env = {**child_env(os.environ), **engine_env(None)}
    server = ForkServer(preload_modules(cfg.generator.engine, gpu), env, logs / "forkserver.log", say)
    server.start()
    return server


def fork_servers(cfg: Config, gpus: GpuPlan, logs: Path, say: Callable[[str], None]) -> dict[str, ForkServer]:
    """The launch's fork servers by the role of the processes they fork, started: they import while the rest of
    the run starts (the launcher waits for one only when it forks its first process)."""
    servers = {
        "learner": learners_fork_server(cfg, bool(gpus.learners), logs, say),
        "generator": generators_fork_server(cfg, bool(gpus.generators), logs, say),
    }
    return {role: server for role, server in servers.items() if server is not None}


def learners_fork_server(cfg: Config, gpu: bool, logs: Path, say: Callable[[str], None]) -> ForkServer | None:
    """A launch's fork server for its local learner ranks (``asyncrl.learners.preload``), started, or None where
    ``run.fork_learners`` is off, the ranks use GPUs (not measured there) or the platform has no subreapers. It
    runs on the ranks' allocator (``learner.jemalloc``): a forked rank keeps its parent's."""
    if not (cfg.run.fork_learners and not gpu and available()):
        return None
    # DeepSpeed's accelerator: the preload's; a missing jemalloc: the launcher says so, for the ranks' own
    env = learner_env(child_env(os.environ), cfg.learner.jemalloc)
    server = ForkServer(["asyncrl.learners.preload"], env, logs / "forkserver-learners.log", say)
    server.start()
    return server


class Forked:
    """A forked generator or learner rank as the launcher holds it: what ``Child`` uses of ``subprocess.Popen``."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: gone, how is unknown
                self.returncode = 1
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's end: :meth:`start` the server (it imports ``preload`` meanwhile), then :meth:`spawn`
    children from it; :meth:`close` at the end. ``say`` gets the one line telling why forks stopped."""

    def __init__(self, preload: list[str], env: dict[str, str], log_path: Path, say: Callable[[str], None] = print):
        self.preload, self.env, self.log_path, self.say = preload, env, log_path, say
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.ready = False

    def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = [sys.executable, "-m", "asyncrl.run.forkserver", "--fd", str(theirs.fileno())]
        cmd += [x for module in self.preload for x in ("--preload", module)]
        try:
            with self.log_path.open("ab") as log:
                self.proc = subprocess.Popen(
                    cmd,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # a terminal's Ctrl-C is the launcher's to handle
                    pass_fds=[theirs.fileno()],
                    preexec_fn=functools.partial(_preexec, os.getpid()),
                )
        except OSError as exc:
            ours.close()
            self._give_up(f"it did not start ({exc})")
        else:
            self.sock = ours
        finally:
            theirs.close()

    def spawn(self, cmd: list[str], env: dict[str, str], log, nice: int, cpus: set[int] | None) -> Forked | None:
        """``cmd`` (``python -m module args...``) forked from the server, writing to ``log`` (a file); None
        where it cannot be: the caller starts it otherwise."""
        if self.sock is None or cmd[1:2] != ["-m"]:
            return None
        request = {"module": cmd[2], "argv": cmd[3:], "env": env, "cwd": os.getcwd(), "nice": nice}
        request.update(cpus=sorted(cpus) if cpus else None, parent=os.getpid())
        try:
            if not self.ready:
                reply = self._receive(READY_TIMEOUT_S, "its imports")
                self.ready = bool(reply.get("ready"))
            _subreaper(True)  # the forked child, orphaned by the middle process, comes to this process
            try:
                socket.send_fds(self.sock, [json.dumps(request).encode()], [log.fileno()])
                pid = int(self._receive(FORK_TIMEOUT_S, "a fork")["pid"])
            finally:
                _subreaper(False)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._give_up(str(exc))
            return None
        child = Forked(pid)
        if _parent_of(pid) != os.getpid():  # not ours to wait for: it ends itself (become)
            self._give_up(f"pid {pid} did not become the launcher's child")
            return None
        return child

    def _receive(self, timeout_s: float, what: str) -> dict:
        self.sock.settimeout(timeout_s)
        try:
            message = self.sock.recv(MAX_MESSAGE)
        except TimeoutError:
            raise OSError(f"no answer within {timeout_s:.0f} s to {what}") from None
        if not message:
            code = self.proc.poll() if self.proc is not None else None
            raise OSError(f"it exited (code {code}) before {what}; see {self.log_path}")
        reply = json.loads(message)
        if not isinstance(reply, dict):
            raise ValueError(f"a reply that is not an object: {message[:80]!r}")
        return reply

    def _give_up(self, why: str) -> None:
        self.say(f"generators start as their own interpreters from now on: the fork server failed: {why}")
        self.close()

    def close(self) -> None:
        """End the server (it also ends when the launcher dies); the children it forked are not its own."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


def _preexec(launcher: int) -> None:
    die_with(launcher)()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # never an ignored Ctrl-C (Child._preexec): its children keep it


def _subreaper(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command's name: state, ppid, ... (proc(5)'s 3rd on)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _parent_of(pid: int) -> int | None:
    try:
        return int(_stat(pid)[1])
    except OSError:
        return None


# -- the server's side -----------------------------------------------------------------------------
def serve(sock: socket.socket, preload: list[str]) -> tuple[dict, list[int]]:
    """Import ``preload``, say ready, and fork for each request until the launcher closes its end. Returns
    only in a forked child: its request and descriptors."""
    # no collection while importing: each walks a heap that only grows (vLLM's imports: ~2 of their ~10 CPU-s
    # here); the cycles they would have freed (~22k objects, ~14 MB) are frozen with the rest, shared by children
    gc.disable()
    try:
        for module in preload:
            importlib.import_module(module)
    finally:
        gc.enable()
    gc.freeze()  # the imports' objects: never walked by a child's collections (nor copied for them)
    sock.send(json.dumps({"ready": True}).encode())
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
        except ConnectionError:
            message, fds = b"", []
        if not message:
            os._exit(0)  # the launcher closed its end, or died
        pid = _fork_twice()
        if pid == 0:
            sock.close()
            return json.loads(message), fds
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())


def _fork_twice() -> int:
    """Fork a child whose parent exits at once (it is re-parented); its pid here, 0 in the child."""
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read)
            pid = os.fork()
            if pid:
                os.write(write, str(pid).encode())
        except BaseException:
            os._exit(1)
        if pid:
            os._exit(0)
        os.close(write)
        return 0
    os.close(write)
    with open(read, "rb") as f:
        answer = f.read()
    os.waitpid(middle, 0)
    if not answer:
        raise OSError("the middle process could not fork")
    return int(answer)


def become(request: dict, fds: list[int]) -> None:
    """This forked process made what the launcher would have started: session, descriptors, environment,
    signals, parent, priority, cores, numpy's seed, ``sys.argv``."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    (log,) = fds
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has them
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    parent, deadline = int(request["parent"]), time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != parent:  # the middle process is exiting: until then the launcher is not ours
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.001)
    die_with(parent)()  # exits at once if the launcher died meanwhile
    lower_priority(int(request["nice"]))
    if request["cpus"]:
        os.sched_setaffinity(0, set(request["cpus"]))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [request["module"], *request["argv"]]
    retitle([sys.executable, "-m", request["module"], *request["argv"]])


def retitle(argv: list[str]) -> None:
    """What ``ps`` shows of this process: ``argv``, written over the server's command line (in place, cut to
    its length, as ``setproctitle`` does), so a forked generator reads as the command it runs."""
    fields = _stat("self")
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of proc(5)
    title = "\0".join(argv).encode()[: end - start - 1]
    ctypes.memmove(start, title.ljust(end - start, b"\0"), end - start)


def main() -> None:
    ap = argparse.ArgumentParser(description="asyncrl's fork server for generators (started by `asyncrl launch`)")
    ap.add_argument("--fd", type=int, required=True, help="the server's end of the launcher's socket pair")
    ap.add_argument("--preload", action="append", default=[], help="a module to import before forking")
    args = ap.parse_args()
    sock = socket.socket(fileno=args.fd)
    request, fds = serve(sock, args.preload)
    become(request, fds)
    run(request["module"])


def run(name: str) -> None:
    """Module ``name`` as ``python -m`` runs it. One imported here already runs its ``main()``: runpy would run
    a second copy of it as ``__main__`` (its own classes and globals), with a RuntimeWarning in the log."""
    module = sys.modules.get(name)
    if module is not None and callable(getattr(module, "main", None)):
        module.main()
    else:
        runpy.run_module(name, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
