"""A sandboxed Python program: model-written code runs in a fresh, limited interpreter, isolated where the host
allows. :func:`run_python` is one call, :class:`Limits` what it may use; the tool a model calls
(``asyncrl.episodes.sandbox:python``) wraps it. It answers with what the code printed: stdout, then stderr, then
an ``error: ...`` line for a limit it hit (``error: wall time limit (10 s) exceeded``) or how it ended (``error:
exit status 1``, ``error: killed by SIGSEGV``). Nothing persists between calls. Linux only.

A call is one process tree: the **bootstrap** (this file run as a script, in a session of its own) forks the
**program**, which execs ``python -E -s -u main.py`` in a fresh working directory with no inherited environment
variable (a minimal ``PATH``, ``HOME`` = the directory, one BLAS thread). CPU time, memory (address space), tasks
(processes and threads: a fork bomb), file size, open files and core dumps (none) are the program's rlimits; a CPU
overrun is a SIGKILL, told apart by the CPU time used. Wall time and output are the parent's: at the deadline, or
at the first byte past ``output_bytes``, it asks the bootstrap to stop (SIGTERM), which SIGKILLs its child, reaps
it and kills its own process group; one not gone within ``_STOP_GRACE_S`` is SIGKILLed with its group, and its
child dies with it (``PR_SET_PDEATHSIG``).

As root, the program also gets new network, mount, PID and IPC namespaces and a uid of its own (above 200000,
one per call: no host file is its, and RLIMIT_NPROC, which root ignores, holds): no network (a loopback, down); a
tmpfs ``/tmp`` of ``disk_mb``, its working directory, also over ``/var/tmp``, ``/dev/shm`` and ``/run/lock``; its
own ``/proc``. The bootstrap's child is the namespace's first process, a minimal init that forks the program and
reaps orphans; when it ends, the kernel kills all that is left in the namespace. A directory others may not enter
on the way to the interpreter (pyenv's ``/root``) is covered, in the namespace only, by an empty tmpfs with the
interpreter's own directories bound back. A uid is reused once no process of it is left.

Root without the right to create namespaces (a default Docker container): the same uid and limits, but network
and world-writable places are reachable, the interpreter must be readable by any user, and what escapes the
process group is killed by uid after the call. Not root: the program can reach the network and write wherever
this user can, a process that calls ``setsid()`` outlives the call, and the task limit counts all of the user's
tasks (it is set to those running + ``processes``). Without namespaces the working directory is a host temp dir,
removed after the call, and a warning says once that the sandbox is not isolated, and why.

Faults: the answer is always text, except for a sandbox that could not be set up (an unreadable interpreter, a
failing mount): ``RuntimeError``, which the tool machinery reports as a ``tool_error``. Cancellation (the
machinery's or the episode's timeout) and every error path stop the sandbox and reap the bootstrap before the
call ends: no process and no zombie is left.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import resource
import signal
import stat
import sys

if __name__ != "__main__":  # the tool's side only: the bootstrap (this file as a script) skips their import time
    import asyncio  # (asyncio alone is ~80 ms, on every call) and has no asyncrl on its path
    import dataclasses
    import logging
    import shutil
    import tempfile

# Defaults of make_python_tool, sized for code-interpreter RL: many short calls whose output a model reads.
CPU_S = 5  # a correct answer to a competition-style task computes in well under a second; 5 s allows slow Python
WALL_S = 10.0  # CPU_S plus interpreter start and some sleeping or IO; the episode's tool_timeout_s default too
MEMORY_MB = 512  # address space: numpy and sympy import well within it; a runaway allocation fails fast
OUTPUT_BYTES = 8192  # ~2k tokens: a useful observation, never one that crowds the episode's token budget out
PROCESSES = 16  # tasks, threads included: a small multiprocessing pool fits, a fork bomb stops there
FILE_MB = 16  # the largest file it may write (RLIMIT_FSIZE: a write past it fails with EFBIG)
DISK_MB = 64  # the private /tmp when isolated (tmpfs: memory, freed with the namespace)

_OPEN_FILES = 256  # RLIMIT_NOFILE: plenty for a script, a bound on kernel memory held through descriptors
CLEANUP_S = 5.0  # the tool machinery's timeout is wall_s + this, so the sandbox's own deadline speaks first
_STOP_GRACE_S = 2.0  # a bootstrap asked to stop ends in milliseconds; this much on a machine under load
_SETUP_FAILED = 127  # the program's exit status when it could not be set up (its status line says why)
_UID_BASE, _UID_SLOTS = 200_000, 256  # uid = base + pid * slots + slot: unique per live process and per call
_SWEEP_ROUNDS, _SWEEP_PAUSE_S = 200, 0.01  # waiting for a uid's last processes to go: at most ~2 s
_WORLD_WRITABLE = ("/var/tmp", "/dev/shm", "/run/lock")  # where a fresh uid could write besides /tmp
_CLONE_NEWNS, _CLONE_NEWIPC, _CLONE_NEWPID, _CLONE_NEWNET = 0x00020000, 0x08000000, 0x20000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG = 1


# ----------------------------------------------------------------------------------- the bootstrap (a script)


def _boot(config: dict) -> None:
    """Reads the program from stdin, enters the namespaces (as root), writes its status line (``isolated``,
    ``why``) and forks: the program, or when isolated the first process of its PID namespace, which runs it. The
    program's parent writes its status line (``returncode`` as ``Popen`` has it, ``cpu_s``). Then it SIGKILLs its
    own process group, itself included, so no straggler in the group outlives it. SIGTERM (the parent's stop)
    SIGKILLs the child, then all goes on as usual: reaped here, never left to the host's init."""
    code, fd = sys.stdin.buffer.read(), config["status_fd"]
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.set_inheritable(fd, False)  # the program never holds it: it cannot forge a status
    isolated, why = False, "not root: the program can reach the network and write wherever this user can"
    if config["uid"] is not None:
        try:
            _libc("unshare", _CLONE_NEWNET | _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWIPC)
            isolated, why = True, ""
        except OSError as exc:
            why = f"no namespaces ({exc}): the program can reach the network and world-writable places"
    os.write(fd, (json.dumps({"isolated": isolated, "why": why}) + "\n").encode())
    me = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # held until the handler knows the child
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        _become_program(config, code, isolated, me)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))  # unreaped: never a recycled pid
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    _wait_program(pid, None if isolated else fd)
    os.killpg(0, signal.SIGKILL)


def _become_program(config: dict, code: bytes, isolated: bool, bootstrap: int) -> None:
    """The forked child: its files, limits and uid, then exec. Isolated, it is pid 1 of the new PID namespace and
    stays there as a minimal init (orphans come to it; a pid 1 ignores signals it has no handler for, so the
    program must not be it): it forks the program and reaps until the program ends. A failure is written to the
    status pipe as ``setup_error`` and exits ``_SETUP_FAILED``."""
    try:
        os.umask(0o022)
        workdir = _private_filesystem(config) if isolated else config["workdir"]
        os.chdir(workdir)
        with open("main.py", "wb") as f:  # root's when root: the program reads it, cannot change it
            f.write(code)
        uid = config["uid"]
        _set_limits(config["limits"], 1 if isolated else 0 if uid is not None else _tasks_of(os.getuid()))
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)  # also makes this process undumpable: the program cannot trace it
        _libc("prctl", _PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
        if not isolated and os.getppid() != bootstrap:  # it died before prctl (in a PID namespace getppid() is 0,
            os._exit(_SETUP_FAILED)  # and the parent's SIGKILL of the group reaches this process instead)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        env |= {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
        exe = config["executable"]  # -E -s: no PYTHON* variable, no user site; its own directory is importable
        if isolated and (program := os.fork()) != 0:
            _wait_program(program, config["status_fd"])
            os._exit(0)
        os.execve(exe, [exe, "-E", "-s", "-u", "main.py"], env)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        with contextlib.suppress(OSError):
            os.write(config["status_fd"], (json.dumps({"setup_error": f"{type(exc).__name__}: {exc}"}) + "\n").encode())
        os._exit(_SETUP_FAILED)


def _wait_program(pid: int, status_fd: int | None) -> None:
    """Reap children (orphans too) until ``pid`` ends; then its status line, if ``status_fd``."""
    while (done := os.wait4(-1, 0))[0] != pid:
        pass
    if status_fd is not None:
        status = {"returncode": os.waitstatus_to_exitcode(done[1]), "cpu_s": done[2].ru_utime + done[2].ru_stime}
        os.write(status_fd, (json.dumps(status) + "\n").encode())


def _private_filesystem(config: dict) -> str:
    """In the new mount namespace (private: no mount here reaches the host): the interpreter made reachable (also
    where it lives under a directory covered next), a tmpfs ``/tmp`` of the sandbox uid over each world-writable
    directory, a ``/proc`` of the new PID namespace
    (best effort: some hosts forbid it). The working directory: ``/tmp`` (``/tmp/work`` when the interpreter
    was bound back under ``/tmp``)."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    _expose(config["expose"])
    covered = ["/tmp", *(p for p in _WORLD_WRITABLE if os.path.isdir(p) and not os.path.islink(p))]
    # an interpreter under a covered directory (a venv in /tmp) is bound back into the private one
    under = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in config["expose"] if _within(p, covered)}
    uid, size = config["uid"], config["limits"]["disk_mb"]
    _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size}m,mode=0700,uid={uid},gid={uid}")
    for path in covered[1:]:
        _mount("/tmp", path, None, _MS_BIND)
    for path, fd in under.items():
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
        os.close(fd)
    if under:  # the program's directory holds only what it writes, not the interpreter's way in
        os.mkdir("/tmp/work", 0o700)
        os.chown("/tmp/work", uid, uid)
    with contextlib.suppress(OSError):
        _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    return "/tmp/work" if under else "/tmp"


def _within(path: str, directories: list[str]) -> bool:
    return any(path == d or path.startswith(d + "/") for d in directories)


def _expose(paths: list[str]) -> None:
    """Each path under a directory others may not enter (``/root``): that directory covered by an empty tmpfs,
    the path bound back at its place (from a descriptor opened before the cover hid it)."""
    held = {}
    for path in paths:
        parts = path.split("/")
        above = ("/".join(parts[:i]) for i in range(2, len(parts)))
        if closed := [a for a in above if not os.stat(a).st_mode & stat.S_IXOTH]:
            held[path] = (closed[0], os.open(path, os.O_PATH | os.O_DIRECTORY))
    for closed in sorted({closed for closed, _ in held.values()}):
        _mount("tmpfs", closed, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    for path, (_, fd) in held.items():
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
        os.close(fd)


def _set_limits(limits: dict, tasks: int) -> None:
    """The program's rlimits, soft = hard (it cannot raise them); RLIMIT_NPROC counts the uid's ``tasks`` besides
    the program's. CPU: SIGKILL at the limit, as a SIGXCPU could be handled and ignored."""
    mb = 1 << 20
    for which, value in (
        (resource.RLIMIT_CPU, math.ceil(limits["cpu_s"])),
        (resource.RLIMIT_AS, limits["memory_mb"] * mb),
        (resource.RLIMIT_NPROC, tasks + limits["processes"]),
        (resource.RLIMIT_FSIZE, limits["file_mb"] * mb),
        (resource.RLIMIT_NOFILE, _OPEN_FILES),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(which, (int(value), int(value)))


def _tasks_of(uid: int) -> int:
    """Tasks (threads) of ``uid`` now: what its RLIMIT_NPROC counts."""
    count = 0
    for name in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{name}").st_uid == uid:
                count += len(os.listdir(f"/proc/{name}/task"))
    return count


def _libc(name: str, *args: object) -> None:
    if getattr(ctypes.CDLL(None, use_errno=True), name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [None if s is None else s.encode() for s in (source, target, fstype)]
    _libc("mount", *args, ctypes.c_ulong(flags), None if data is None else data.encode())


if __name__ == "__main__":  # this file run as a script: the bootstrap, which never returns
    _boot(json.loads(sys.argv[1]))
    os._exit(_SETUP_FAILED)


# ----------------------------------------------------------------------------------- the caller's side

log = logging.getLogger("asyncrl.service.sandbox")
_taken_uids: set[int] = set()
_warned: set[str] = set()  # the reasons a sandbox was not isolated, each logged once


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one call may use; every field positive (``ValueError``)."""

    cpu_s: int = CPU_S  # CPU seconds (RLIMIT_CPU; a fraction rounds up)
    wall_s: float = WALL_S  # wall-clock seconds from the spawn, interpreter start included
    memory_mb: int = MEMORY_MB  # address space (RLIMIT_AS)
    output_bytes: int = OUTPUT_BYTES  # stdout + stderr kept; past it the rest is cut and the program stopped
    processes: int = PROCESSES  # tasks, threads included (RLIMIT_NPROC)
    file_mb: int = FILE_MB  # the largest file (RLIMIT_FSIZE)
    disk_mb: int = DISK_MB  # the private /tmp when isolated

    def __post_init__(self):
        for name, value in dataclasses.asdict(self).items():
            if not value > 0:
                raise ValueError(f"sandbox limit {name} must be positive, not {value!r}")


async def run_python(code: str, limits: Limits = Limits()) -> str:  # noqa: B008 - frozen, shared safely
    """Run ``code`` in a fresh sandbox (see the module's docstring); what it printed and how it ended, as text."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a string, not {type(code).__name__}")
    status: dict = {}
    ended, status_r, status_w, workdir = False, -1, -1, ""  # ended: by itself, its PID namespace emptied
    uid = _take_uid() if _privileged() else None
    try:
        status_r, status_w = os.pipe()
        workdir = tempfile.mkdtemp(prefix="asyncrl-sandbox-")  # the program's unless it has a private /tmp
        if uid is not None:
            os.chown(workdir, uid, uid)
        proc = await _spawn(uid, workdir, status_w, limits)
        os.close(status_w)
        status_w = -1
        try:
            output, wall_hit = await _supervise(proc, code.encode(), limits)
        finally:
            ended = await _stop(proc)
        status = _read_status(status_r)
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        if uid is not None:
            await _release_uid(uid, swept=ended and status.get("isolated", False))
        if workdir:
            await asyncio.to_thread(_remove, workdir)  # a program may leave many files: not on the loop
    if "setup_error" in status:
        raise RuntimeError(f"the sandbox could not be set up: {status['setup_error']}")
    if status and not status["isolated"] and status["why"] not in _warned:
        _warned.add(status["why"])
        log.warning("python sandbox not isolated: %s", status["why"])
    return _report(output, wall_hit, status, limits)


def _privileged() -> bool:
    """Root: the sandbox takes a uid of its own and namespaces (tests patch this to try the other path)."""
    return os.geteuid() == 0


async def _spawn(uid: int | None, workdir: str, status_fd: int, limits: Limits) -> asyncio.subprocess.Process:
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))}
    expose = sorted(p for p in prefixes if not any(p.startswith(q + "/") for q in prefixes))  # outermost only
    config = {"uid": uid, "workdir": workdir, "status_fd": status_fd, "executable": sys.executable}
    config |= {"expose": expose, "limits": dataclasses.asdict(limits)}
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(config)]
    pipe, env = asyncio.subprocess.PIPE, {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    return await asyncio.create_subprocess_exec(
        *argv, stdin=pipe, stdout=pipe, stderr=pipe, pass_fds=(status_fd,), start_new_session=True, cwd="/", env=env
    )


class _Output:
    """stdout and stderr, at most ``limit`` bytes together; the first byte past it calls ``on_full`` (the stop)
    and the rest is read and dropped, so the parent's memory stays bounded."""

    def __init__(self, limit: int, on_full):
        self.limit, self.on_full = limit, on_full
        self.kept = {"out": bytearray(), "err": bytearray()}
        self.truncated = False

    async def drain(self, stream: asyncio.StreamReader, key: str) -> None:
        while chunk := await stream.read(1 << 16):
            room = max(self.limit - sum(map(len, self.kept.values())), 0)
            self.kept[key] += chunk[:room]
            if len(chunk) > room and not self.truncated:
                self.truncated = True
                self.on_full()

    def text(self, key: str) -> str:
        return self.kept[key].decode("utf-8", "replace")


async def _supervise(proc: asyncio.subprocess.Process, code: bytes, limits: Limits) -> tuple[_Output, bool]:
    """Feed the program, read its output and wait for the bootstrap, within ``wall_s``: (output, wall hit).
    What was printed before the deadline is kept; the caller stops the sandbox."""
    output = _Output(limits.output_bytes, lambda: _signal(proc, signal.SIGTERM))

    async def feed() -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it died first: its status says why
            proc.stdin.write(code)
            await proc.stdin.drain()
            proc.stdin.close()

    try:
        async with asyncio.timeout(limits.wall_s):
            drain = output.drain
            await asyncio.gather(feed(), drain(proc.stdout, "out"), drain(proc.stderr, "err"), proc.wait())
    except TimeoutError:
        return output, True
    return output, False


async def _stop(proc: asyncio.subprocess.Process) -> bool:
    """End the sandbox and reap its bootstrap, on every path, cancellation included: SIGTERM asks the bootstrap to
    kill and reap its child; one not gone within ``_STOP_GRACE_S`` (a program not isolated from it may have
    stopped it) is SIGKILLed with its whole process group. Whether it ended by itself."""
    if proc.returncode is None:
        _signal(proc, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), _STOP_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # unreaped, so the group is still its
            await proc.wait()
            return False
    return True


def _signal(proc: asyncio.subprocess.Process, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signum)


def _read_status(fd: int) -> dict:
    """The status lines (a few, all written before the bootstrap ended), merged; {} if none was written."""
    os.set_blocking(fd, False)
    status = {}
    with contextlib.suppress(BlockingIOError):
        for line in os.read(fd, 1 << 20).splitlines():
            status |= json.loads(line)
    return status


def _report(output: _Output, wall_hit: bool, status: dict, limits: Limits) -> str:
    parts = [output.text(key).rstrip("\n") for key in ("out", "err") if output.kept[key]]
    return "\n".join(parts + _verdict(output, wall_hit, status, limits)) or "(no output)"


def _verdict(output: _Output, wall_hit: bool, status: dict, limits: Limits) -> list[str]:
    """The ``error: ...`` lines: the limit that ended the program, else its exit status or signal."""
    if output.truncated:
        return [f"error: output limit ({limits.output_bytes} bytes) exceeded: the rest was cut, the program stopped"]
    if wall_hit:
        return [f"error: wall time limit ({limits.wall_s:g} s) exceeded"]
    if (rc := status.get("returncode")) in (0, None):
        return [] if rc == 0 else ["error: the sandbox ended without a status"]
    tail = output.text("err")[-2000:]
    if "MemoryError" in tail or "Cannot allocate memory" in tail:
        return [f"error: memory limit ({limits.memory_mb} MB) exceeded"]
    if rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and status["cpu_s"] >= math.ceil(limits.cpu_s) - 0.1):
        return [f"error: CPU time limit ({limits.cpu_s} s) exceeded"]
    if rc == -signal.SIGXFSZ or "File too large" in tail:
        return [f"error: file size limit ({limits.file_mb} MB) exceeded"]
    lines = []
    if "can't start new thread" in tail or ("BlockingIOError" in tail and "fork" in tail):
        lines.append(f"error: process limit ({limits.processes}, threads included) reached")
    if rc > 0:
        return [*lines, f"error: exit status {rc}"]
    try:
        return [*lines, f"error: killed by {signal.Signals(-rc).name}"]
    except ValueError:  # a signal without a name (real-time)
        return [*lines, f"error: killed by signal {-rc}"]


# ----------------------------------------------------------------------------------- uids and cleanup


def sandbox_uids() -> range:
    """The uids this process's sandboxes run as (when root)."""
    start = _UID_BASE + os.getpid() * _UID_SLOTS
    return range(start, start + _UID_SLOTS)


def _take_uid() -> int:
    uid = next((u for u in sandbox_uids() if u not in _taken_uids), None)
    if uid is None:
        raise RuntimeError(f"more than {_UID_SLOTS} sandboxes at once in one process")
    _taken_uids.add(uid)
    return uid


async def _release_uid(uid: int, swept: bool) -> None:
    """Free ``uid`` once no process of it is left: the kernel killed them when the program's PID namespace ended
    (``swept``); otherwise each is SIGKILLed here, through a pidfd (never a recycled pid). A uid whose processes
    outlive ``_SWEEP_ROUNDS`` stays taken."""
    for _ in range(_SWEEP_ROUNDS):
        pids = [] if swept else [int(p) for p in filter(str.isdigit, os.listdir("/proc")) if _uid_of(p) == uid]
        if not pids:
            _taken_uids.discard(uid)
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                fd = os.pidfd_open(pid)
                try:
                    if _uid_of(str(pid)) == uid:  # still the same process: the pidfd holds it
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                finally:
                    os.close(fd)
        await asyncio.sleep(_SWEEP_PAUSE_S)
    log.warning("python sandbox: processes of uid %d outlived their sandbox; the uid is not reused", uid)


def _uid_of(pid: str) -> int | None:
    """A process's real uid (a zombie's too), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration, ValueError):
        return None


def _remove(path: str) -> None:
    """Remove a working directory. Not root, the program may have left a directory unreadable (``chmod 000``):
    each is made ours again first (never through a symlink)."""
    if os.geteuid() != 0:
        for root, dirs, _ in os.walk(path):
            for d in (os.path.join(root, d) for d in dirs):
                if not os.path.islink(d):
                    with contextlib.suppress(OSError):
                        os.chmod(d, 0o700)
    shutil.rmtree(path, ignore_errors=True)
