"""DeepSpeed's JIT-built CPU op (its shared-memory allreduce), built once per environment, under a lock that dies
with its builder.

DeepSpeed builds the op at a CPU rank's first start (about a minute on 2 cores, where ``scripts/setup.sh`` did
not prebuild it) through torch's ``cpp_extension``, whose lock is a FILE (``<build dir>/lock``, created with
``O_EXCL``, removed when the build ends): a builder killed mid-build (Ctrl-C of a first launch, a launch that
stops on a config error while its learners build) leaves it behind, and every later rank then waits on it
forever. Here every build of ours runs while holding :data:`LOCK_NAME` with ``flock``, which the kernel
releases when its holder dies: whoever holds it and still finds torch's lock file knows no build of ours is
running, and removes it unless another process (a build that is not ours) works in the build directory. The
op is then loaded into DeepSpeed's own cache, so the rank's ``deepspeed.initialize`` takes it from there.

Invariants: at most one build per extensions directory at a time; a lock file with no live builder never
blocks a start; what a rank waits for is said through ``phase`` (the launcher reports a rank that is not up).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from asyncrl.lifetime import torch_extensions_dir

log = logging.getLogger(__name__)

OP_BUILDER = "ShareMemCommBuilder"  # DeepSpeed's CPU accelerator loads this op when its comm backend starts
LOCK_NAME = ".asyncrl-build.lock"  # in the extensions directory: held with flock by whoever builds or loads
WAIT_POLL_S = 0.5  # how often a rank looks again at a lock file that a live foreign build holds


def extensions_dir() -> Path:
    """Where torch builds and finds JIT extensions in this process (``TORCH_EXTENSIONS_DIR``, else torch's)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def load_cpu_op(phase: Callable[[str], None] = lambda what: None):
    """DeepSpeed's shared-memory op, built if need be (the caller waits for it), or None where DeepSpeed's
    accelerator has none (a GPU). ``phase(what)`` is told what this process waits for while it waits."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops import __compatible_ops__

    builder = get_accelerator().create_op_builder(OP_BUILDER)
    if builder is None or not __compatible_ops__.get(builder.NAME, False):
        return None
    root = extensions_dir()
    with build_lock(root, phase):
        clear_stale_lock(root / builder.NAME, phase)
        built = (root / builder.NAME / f"{builder.NAME}.so").is_file()  # ninja then finds nothing to do
        doing = "loading" if built else "building (about a minute on 2 cores, once)"
        phase(f"{doing} DeepSpeed's {builder.NAME} op in {root / builder.NAME}")
        return builder.load()


@contextlib.contextmanager
def build_lock(root: Path, phase: Callable[[str], None]) -> Iterator[None]:
    """``root``'s build lock, held until the block ends or this process dies (``flock``)."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            phase(f"waiting for another process's build in {root} ({LOCK_NAME})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def clear_stale_lock(build_dir: Path, phase: Callable[[str], None]) -> None:
    """Remove torch's lock file in ``build_dir`` when no build holds it. Called under :func:`build_lock`, so
    no build of ours runs; a lock file there is stale unless a process that is not ours builds in ``build_dir``
    (its compiler runs there: :func:`working_in`), which is waited for."""
    lock = build_dir / "lock"
    said = False
    while lock.exists():
        if not working_in(build_dir):
            log.warning("removing %s: left by a build that was killed (no process builds there)", lock)
            lock.unlink(missing_ok=True)
            return
        if not said:
            phase(f"waiting for {lock}: a build that is not this run's works in {build_dir}")
            said = True
        time.sleep(WAIT_POLL_S)


def working_in(directory: Path) -> list[int]:
    """The pids of this machine's processes whose working directory is ``directory`` (torch runs ninja, and
    ninja the compiler, there); those whose directory cannot be read (another user's) are left out."""
    target = directory.resolve()
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if Path(os.readlink(f"/proc/{entry.name}/cwd")) == target:
                pids.append(int(entry.name))
    return pids


def main() -> None:
    """``python -m asyncrl.learners.ops``: build the op now (``scripts/setup.sh``), as a rank would."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(torch_extensions_dir()))  # the launch's (lifetime.child_env)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    op = load_cpu_op(phase=log.info)
    print("no CPU op to build here" if op is None else f"DeepSpeed's CPU op is built in {extensions_dir()}")


if __name__ == "__main__":
    main()
