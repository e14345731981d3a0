"""Same-host shared-memory weight bus: each version is written ONCE into a file on a tmpfs
(``/dev/shm``) and every local generator maps that file; tensors are zero-copy views of the mapping,
so eight subscribers cost about what one does.

Address: ``shm://<dir>``, the publisher's private directory ``<root>/asyncrl-w-<pid>-<random>``
(``root`` is ``WeightsConfig.shm_dir``; mode 0700, so generators run as the learner's user)::

    owner.json       {"pid": int, "start": int | null}  the publishing process (see remove_stale_shm)
    announce         ZeroMQ ipc PUB socket: one wake-up message per new version, never data
    v<version>.wts   the newest sealed version (mode 0444): the only name subscribers open
    .f<k>            spare files: the version being written, retired versions kept for reuse

A version file (little-endian; no pickle)::

    [0, 64)          header: magic b"asyncrl.shmw/2\\0\\0", u64 manifest_offset, u64 manifest_nbytes,
                     16-byte xxh3-128 of the manifest, u64 version, u64 file_nbytes
    [4096, ...)      buckets, each page-aligned; inside a bucket tensors sit at multiples of 64
                     (the bucket plan of ``asyncrl.weights.wire``)
    [manifest_offset, file_nbytes)  msgpack manifest: the wire manifest, except that "buckets" are
                     [{"offset": file offset, "nbytes": int}] and only the whole "checksum"
                     (``state_dict_checksum``) is carried

Invariants and concurrency:

- Atomic visibility. A version is copied (``publish``, caller's thread) and sealed (background
  thread: checksum, manifest, header, chmod 0444) under a ``.f<k>`` name, then renamed to
  ``v<version>.wts``; a reader never sees a partial file. The directory is the source of truth:
  a subscriber's every ``poll`` looks for the newest ``v*.wts``, so a late joiner gets the newest
  version on its first poll; the announce socket only wakes pollers that wait (``timeout_ms > 0``),
  and they rescan every ``_RESCAN_MS`` anyway, so a lost wake-up costs at most that.
- No overwrite under a reader, no waiting on one. The publisher holds ``flock(LOCK_EX)`` on a file
  while writing it. A subscriber takes ``LOCK_SH | LOCK_NB`` before reading and keeps that fd (and
  so the lock) open until the last tensor of that version is garbage-collected. The publisher
  reuses a retired file only if ``LOCK_EX | LOCK_NB`` succeeds, else it takes another or a new
  one; files still held beyond ``_MAX_SPARES`` are unlinked (their memory lives until the holder
  drops its tensors). Nothing on either side blocks on the other; a SIGKILLed subscriber's locks
  vanish with its fds. A subscriber whose file was renamed or reused between its directory scan
  and its open sees ENOENT, a busy lock or a header of another version, and rescans.
- Reuse matters for speed: writing 500 MB into fresh tmpfs pages costs ~0.6-0.8 s here (page
  faults and zeroing), into already-faulted pages ~0.09 s (memcpy speed).
- Subscribers map with MAP_PRIVATE (``ACCESS_COPY``): reads share the publisher's page-cache pages,
  a write into a tensor changes only that process's copy of the page, never the file.
- Verification. The publisher hashes the bytes once, from the file itself, after copying
  (``state_dict_checksum``, so ``WeightUpdate.checksum`` means what it means over zmq). A
  subscriber always checks what is O(tensors): header, manifest digest and schema, file size,
  bucket and tensor extents, dtype/shape/nbytes agreement, so a truncated or mismatched file is
  rejected. ``verify="full"`` also re-hashes every byte in every subscriber, O(bytes) each
  (xxh3-128, about 10 GB/s on one core here). The only writer of the file is the publisher, which
  hashed those very bytes before making the file read-only and visible, so re-hashing buys little:
  the default is ``"structure"``, and ``"full"`` is for chasing a suspected corruption. A version's
  latency is the copy (~0.1 s per 500 MB here, memcpy speed into reused pages) plus the
  publisher's hash (~0.05 s). A rejected version is logged, counted in ``rejected`` and
  never retried; the previous version stays current.
- Lifetime. At most one ``v*.wts`` is visible; retired files are renamed away at once and reused
  or unlinked (an unlinked file stays valid while mapped). ``close`` removes the directory, and so
  does normal interpreter exit; a publisher killed by a signal leaves it behind, for
  ``remove_stale_shm`` (the launcher calls it at the end of a run) to remove once the owner is dead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import mmap
import os
import re
import shutil
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack
import numpy as np
import zmq

from asyncrl.weights.base import WeightPublisher, WeightSubscriber, check_publish, log, log_rejection
from asyncrl.weights.wire import (
    ALIGN,
    WIRE_HEADER,
    WeightsRejected,
    WeightUpdate,
    check_entries,
    checksums,
    peek_version,
    plan,
    tensor_digest,
    tensor_views,
)
from asyncrl.weights.zmq_bus import bus_context

if TYPE_CHECKING:
    import torch

SCHEME = "shm://"
DEFAULT_ROOT = "/dev/shm"
DIR_PREFIX = "asyncrl-w-"
MAGIC = b"asyncrl.shmw/2\0\0"
_HEADER = struct.Struct("<16sQQ16sQQ")  # magic, manifest offset, manifest nbytes, digest, version, file nbytes
_DATA_START = 4096  # buckets start on a page: the header never shares a page with tensor bytes
_PAGE = 4096
_LIVE_RE = re.compile(r"v(\d+)\.wts")
_DIR_RE = re.compile(re.escape(DIR_PREFIX) + r"(\d+)-\w+")
# Spare files kept for reuse. Steady state needs one (the live version is the other file); a
# generator that keeps an old version's tensors pins its file, so allow a second before unlinking.
_MAX_SPARES = 2
# A waiting poll rescans the directory at least this often, in case a wake-up was missed (a SUB
# socket that connects just after a PUB send never sees it).
_RESCAN_MS = 100
# Open attempts per poll when files are renamed under the subscriber (each loss means a newer
# version appeared meanwhile, so a few attempts always suffice unless versions arrive every µs).
_OPEN_TRIES = 4


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _layout(state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[list[dict], list[dict], int]:
    """Manifest tensor entries, bucket placement in the file, and the end of the data region."""
    if not all(isinstance(k, str) for k in state_dict):
        raise TypeError("state dict names must be strings")
    entries, sizes = plan(state_dict, bucket_bytes)
    buckets, offset = [], _DATA_START
    for n in sizes:
        buckets.append({"offset": offset, "nbytes": n})
        offset = _align(offset + n, _PAGE)
    return entries, buckets, max(offset, _DATA_START)


@dataclasses.dataclass(eq=False)
class _File:
    """One file of the publisher's pool, with the publisher's own read-write mapping of its data."""

    fd: int
    name: str  # current name inside the directory
    mm: mmap.mmap | None = None
    size: int = 0  # bytes mapped (the data region of the version last written)


@dataclasses.dataclass
class _Pending:
    file: _File
    version: int
    entries: list[dict]
    buckets: list[dict]
    data_end: int
    created_at: float


class ShmWeightPublisher(WeightPublisher):
    def __init__(self, root: str = DEFAULT_ROOT, bucket_bytes: int = 64 << 20) -> None:
        self.bucket_bytes = bucket_bytes
        self.dir = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=root))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.dir), True)  # also at exit
        owner = {"pid": os.getpid(), "start": _start_time(os.getpid())}
        (self.dir / "owner.json").write_text(json.dumps(owner))
        self.address = f"{SCHEME}{self.dir}"
        self._pub = bus_context().socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 4)  # wake-ups only: dropping some is harmless
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(f"ipc://{self.dir}/announce")  # from here on only the thread touches it
        self._cond = threading.Condition()
        self._pending: _Pending | None = None
        self._live: _File | None = None
        self._spares: list[_File] = []  # oldest first
        self._next_file = 0
        self._last_version: int | None = None
        self._closing = False
        self._stats = {
            "versions": 0,  # sealed and made visible (a version superseded before sealing is skipped)
            "latest": -1,  # the newest visible version
            "files_created": 0,
            "files_reused": 0,
            "copy_ms": 0,  # last publish() call
            "seal_ms": 0,  # last checksum + manifest + rename
        }
        self._thread = threading.Thread(target=self._run, name="weights-shm-publisher", daemon=True)
        self._thread.start()

    # --- caller side ---------------------------------------------------------------------------
    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        check_publish(version, self._last_version, self._closing)
        t0 = time.perf_counter()
        entries, buckets, data_end = _layout(state_dict, self.bucket_bytes)
        f = self._acquire(data_end)
        try:
            _copy_into(f.mm, state_dict, entries, buckets)
        except BaseException:
            self._give_back(f)
            raise
        pending = _Pending(f, int(version), entries, buckets, data_end, time.time())
        with self._cond:
            if self._pending is not None:  # superseded before the thread took it
                self._give_back(self._pending.file)
            self._pending = pending
            self._last_version = version
            self._cond.notify()
        self._stats["copy_ms"] = int((time.perf_counter() - t0) * 1000)

    def stats(self) -> dict[str, int]:
        return {**self._stats, "spares": len(self._spares)}

    def close(self) -> None:
        if self._closing:
            return
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()  # bounded: at most one seal in progress
        self._pub.close()
        with self._cond:
            files = [*self._spares, *([self._live] if self._live else [])]
            if self._pending is not None:
                files.append(self._pending.file)
            self._spares, self._live, self._pending = [], None, None
        for f in files:
            _drop(f, self.dir)
        self._finalizer()  # removes the directory; subscribers' mappings stay valid

    def _acquire(self, nbytes: int) -> _File:
        """A file nobody maps, locked exclusively, with a mapping of ``nbytes`` and a void header."""
        with self._cond:
            f = None
            for spare in self._spares:
                try:
                    fcntl.flock(spare.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a subscriber still maps it
                f = spare
                break
            if f is not None:
                self._spares.remove(f)
                self._stats["files_reused"] += 1
            else:
                f = self._new_file()
        if f.size != nbytes:
            try:
                _remap(f, nbytes, self.dir)
            except BaseException:
                _drop(f, self.dir)
                raise
        f.mm[: _HEADER.size] = bytes(_HEADER.size)
        return f

    def _new_file(self) -> _File:
        name = f".f{self._next_file}"
        self._next_file += 1
        fd = os.open(self.dir / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._stats["files_created"] += 1
        return _File(fd, name)

    def _give_back(self, f: _File) -> None:
        with self._cond:  # an RLock: callers may already hold it
            fcntl.flock(f.fd, fcntl.LOCK_UN)
            self._add_spare(f)

    def _add_spare(self, f: _File) -> None:
        """Keep ``f`` for reuse; beyond ``_MAX_SPARES`` forget the oldest (caller holds the lock)."""
        self._spares.append(f)
        while len(self._spares) > _MAX_SPARES:
            _drop(self._spares.pop(0), self.dir)

    # --- background thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closing)
                if self._closing:
                    return
                pending, self._pending = self._pending, None
            try:
                self._seal(pending)
            except Exception:  # noqa: BLE001 - the bus must outlive one bad version
                log.exception("weights: shm publisher failed to seal version %d", pending.version)
                self._give_back(pending.file)

    def _seal(self, p: _Pending) -> None:
        """Checksum, manifest, header, then make the file visible as ``v<version>.wts``."""
        t0 = time.perf_counter()
        f = p.file
        data = memoryview(f.mm)
        views = [data[b["offset"] : b["offset"] + b["nbytes"]] for b in p.buckets]
        _, checksum = checksums(p.entries, views)
        del views, data  # the mapping must have no exports when it is next resized
        manifest = msgpack.packb(
            {
                "version": p.version,
                "tensors": p.entries,
                "buckets": p.buckets,
                "checksum": checksum,
                "created_at": p.created_at,
            }
        )
        moff = _align(p.data_end, ALIGN)
        end = moff + len(manifest)
        os.ftruncate(f.fd, end)
        os.pwrite(f.fd, manifest, moff)
        digest = tensor_digest(manifest)
        f.mm[: _HEADER.size] = _HEADER.pack(MAGIC, moff, len(manifest), digest, p.version, end)
        os.fchmod(f.fd, 0o444)
        fcntl.flock(f.fd, fcntl.LOCK_UN)  # complete: a reader that opened this inode earlier may read it
        live_name = f"v{p.version}.wts"
        os.rename(self.dir / f.name, self.dir / live_name)
        f.name = live_name
        with self._cond:
            old, self._live = self._live, f
            if old is not None:  # retire: out of subscribers' sight at once, kept for reuse
                spare_name = f".f{self._next_file}"
                self._next_file += 1
                os.rename(self.dir / old.name, self.dir / spare_name)
                old.name = spare_name
                self._add_spare(old)
        with contextlib.suppress(zmq.Again):
            self._pub.send(msgpack.packb(p.version), zmq.NOBLOCK)
        self._stats["versions"] += 1
        self._stats["latest"] = p.version
        self._stats["seal_ms"] = int((time.perf_counter() - t0) * 1000)


def _copy_into(mm: mmap.mmap, state_dict: dict, entries: list[dict], buckets: list[dict]) -> None:
    """The one copy of ``publish``: each tensor's bytes to its place in the mapping (also from GPU).

    CPU tensors are copied by numpy, one thread: torch's copy runs an OpenMP region per tensor, and
    on a busy machine (a learner's own threads, other processes) each region waits for its slowest
    thread to be scheduled; measured here with one core taken: 0.95 s instead of 0.1 s for 500 MB.
    """
    import torch

    dst = np.frombuffer(mm, np.uint8)
    for e in entries:
        if e["nbytes"]:
            start = buckets[e["bucket"]]["offset"] + e["offset"]
            src = state_dict[e["name"]].detach().reshape(-1).view(torch.uint8)
            if src.device.type == "cpu":
                np.copyto(dst[start : start + e["nbytes"]], src.numpy())
            else:
                torch.from_numpy(dst[start : start + e["nbytes"]]).copy_(src)


def _remap(f: _File, nbytes: int, root: Path) -> None:
    """Resize ``f`` to ``nbytes`` of reserved space (a full tmpfs fails here, not with SIGBUS later)."""
    if f.mm is not None:
        f.mm.close()
        f.mm = None
    os.ftruncate(f.fd, nbytes)
    try:
        os.posix_fallocate(f.fd, 0, nbytes)
    except OSError as exc:
        raise RuntimeError(
            f"cannot reserve {nbytes >> 20} MiB in {root.parent} for weights ({exc}); give it more room "
            "(Docker: --shm-size) or use weights.transport=zmq"
        ) from exc
    f.mm = mmap.mmap(f.fd, nbytes)
    f.size = nbytes


def _drop(f: _File, root: Path) -> None:
    """Forget a file: unlink it (a subscriber's mapping stays valid) and release the publisher's ends."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root / f.name)
    if f.mm is not None:
        with contextlib.suppress(BufferError):
            f.mm.close()  # else unmapped when the last view goes
    os.close(f.fd)


class ShmWeightSubscriber(WeightSubscriber):
    def __init__(self, address: str, subscriber_id: str, have: int = -1, verify: str = "structure") -> None:
        if not address.startswith(SCHEME):
            raise ValueError(f"not a shm weight bus address: {address!r}")
        if verify not in ("structure", "full"):
            raise ValueError(f"verify must be 'structure' or 'full', not {verify!r}")
        self.address = address
        self.dir = Path(address.removeprefix(SCHEME))
        self.subscriber_id = subscriber_id
        self.latest_version = have
        self.rejected = 0
        self.verify = verify
        self._bad: set[int] = set()  # rejected versions: never retried
        self._sock = bus_context().socket(zmq.SUB)
        self._sock.setsockopt(zmq.CONFLATE, 1)  # one pending wake-up is as good as many
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(f"ipc://{self.dir}/announce")
        self._closed = False

    def poll(self, timeout_ms: int = 0) -> WeightUpdate | None:
        if self._closed:
            raise RuntimeError("poll on a closed weight subscriber")
        deadline = time.monotonic() + max(timeout_ms, 0) / 1000
        while True:
            update = self._take_newest()
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if update is not None or remaining_ms <= 0:
                return update
            if self._sock.poll(min(remaining_ms, _RESCAN_MS), zmq.POLLIN):
                with contextlib.suppress(zmq.Again):
                    while True:
                        self._sock.recv(zmq.NOBLOCK)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()

    def _candidates(self) -> list[int]:
        """Versions on disk newer than ours and not rejected, newest first."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []  # publisher not started yet, or gone
        found = (_LIVE_RE.fullmatch(n) for n in names)
        versions = (int(m[1]) for m in found if m)
        return sorted((v for v in versions if v > self.latest_version and v not in self._bad), reverse=True)

    def _take_newest(self) -> WeightUpdate | None:
        for _ in range(_OPEN_TRIES):
            candidates = self._candidates()
            for version in candidates:
                try:
                    update = self._open(version)
                except WeightsRejected as exc:
                    self._bad.add(version)
                    self.rejected += 1
                    log_rejection(self.subscriber_id, version, str(exc), self.latest_version)
                    continue  # an older good one on disk may still be newer than ours
                if update is None:
                    break  # renamed or reused meanwhile: rescan
                self.latest_version = update.version
                return update
            else:
                return None
        return None

    def _open(self, version: int) -> WeightUpdate | None:
        """The version in ``v<version>.wts``; None if that file went away; raises WeightsRejected."""
        try:
            fd = os.open(self.dir / f"v{version}.wts", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        keep = False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # being rewritten: it is no longer this version
            size = os.fstat(fd).st_size
            header = os.pread(fd, _HEADER.size, 0)
            if len(header) == _HEADER.size and _HEADER.unpack(header)[4] != version and header[:16] == MAGIC:
                return None  # reused for a newer version after our scan
            manifest, data_end = _read_manifest(fd, header, size, version)
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
            update = _build(manifest, data_end, mm, self.verify)
            # The shared lock lives as long as the mapping, i.e. as long as any of its tensors.
            weakref.finalize(mm, os.close, fd)
            keep = True
            return update
        finally:
            if not keep:
                os.close(fd)


def _read_manifest(fd: int, header: bytes, size: int, version: int) -> tuple[dict, int]:
    """The verified manifest and where it starts (the end of the data region)."""
    if len(header) != _HEADER.size:
        raise WeightsRejected(f"file of {size} bytes has no header")
    magic, moff, mlen, digest, hversion, end = _HEADER.unpack(header)
    if magic != MAGIC:
        raise WeightsRejected(f"unknown file magic {magic!r}")
    if end != size:
        raise WeightsRejected(f"file has {size} bytes, header says {end}")
    if not _DATA_START <= moff <= moff + mlen == end:
        raise WeightsRejected(f"manifest at [{moff}, +{mlen}) does not end the {end}-byte file")
    raw = os.pread(fd, mlen, moff)
    if tensor_digest(raw) != digest:
        raise WeightsRejected("manifest digest mismatch")
    got, manifest = peek_version([WIRE_HEADER, raw])
    if got != hversion or got != version:
        raise WeightsRejected(f"manifest version {got}, header {hversion}, file name {version}")
    return manifest, moff


def _bucket_views(manifest: dict, data_end: int, data: memoryview) -> list[memoryview]:
    views = []
    for i, b in enumerate(manifest["buckets"]):
        off, n = (b.get("offset"), b.get("nbytes")) if isinstance(b, dict) else (None, None)
        if not (isinstance(off, int) and isinstance(n, int) and n >= 0 and off % ALIGN == 0):
            raise WeightsRejected(f"bucket {i}: bad placement {b!r:.80}")
        if not _DATA_START <= off <= off + n <= data_end:
            raise WeightsRejected(f"bucket {i}: bytes [{off}, +{n}) outside the data region")
        views.append(data[off : off + n])
    return views


def _build(manifest: dict, data_end: int, mm: mmap.mmap, verify: str) -> WeightUpdate:
    """Check the manifest against the mapping (and hash it under ``verify="full"``); zero-copy tensors."""
    import torch

    data = memoryview(mm)
    views = _bucket_views(manifest, data_end, data)
    check_entries(manifest["tensors"], [v.nbytes for v in views])
    entries = sorted(manifest["tensors"], key=lambda e: e["name"])
    if verify == "full":
        _, checksum = checksums(entries, views)
        if checksum != manifest["checksum"]:
            raise WeightsRejected("state dict checksum mismatch")
    del views, data
    base = torch.frombuffer(mm, dtype=torch.uint8) if len(mm) else torch.empty(0, dtype=torch.uint8)
    tensors = tensor_views(entries, [base[b["offset"] : b["offset"] + b["nbytes"]] for b in manifest["buckets"]])
    return WeightUpdate(
        version=manifest["version"],
        tensors=tensors,
        checksum=manifest["checksum"],
        nbytes=sum(e["nbytes"] for e in entries),
        received_at=time.time(),
        published_at=float(manifest.get("created_at", 0.0) or 0.0),
    )


# --- leftovers of dead publishers ------------------------------------------------------------------
def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is [0], start time is [19])."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def _start_time(pid: int) -> int | None:
    fields = _proc_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def owner_alive(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` (started at clock tick ``start``, if known) still runs; a zombie and a
    reused pid count as dead. Only meaningful in the publisher's pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    fields = _proc_stat(pid)
    if fields is None:
        return True  # no /proc: trust kill()
    if fields[0] in ("Z", "X"):
        return False
    return start is None or len(fields) <= 19 or int(fields[19]) == start


def remove_stale_shm(root: str = DEFAULT_ROOT, alive: Callable[[int, int | None], bool] = owner_alive) -> list[str]:
    """Remove the shm bus directories under ``root`` whose publisher process is dead; returns them.

    A publisher removes its own directory on ``close`` and at normal exit; this is for the ones
    killed by a signal. ``alive(pid, start)`` decides (default: ``owner_alive``). Live publishers'
    directories, and anything not named like one, are left alone.
    """
    removed = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return removed
    for entry in entries:
        m = _DIR_RE.fullmatch(entry.name)
        if not m or not entry.is_dir(follow_symlinks=False):
            continue
        pid, start = int(m[1]), None
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            owner = json.loads(Path(entry.path, "owner.json").read_text())
            pid, start = int(owner["pid"]), owner.get("start")
        if alive(pid, start):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        log.info("weights: removed %s of dead publisher %d", entry.path, pid)
        removed.append(entry.path)
    return removed
