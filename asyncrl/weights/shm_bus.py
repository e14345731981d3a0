"""Same-host shared-memory weight bus: each version is written ONCE into a file on a tmpfs
(``/dev/shm``) and every local generator maps that file; tensors are zero-copy views of the mapping,
so eight subscribers cost about what one does.

Address: ``shm://<dir>``, the publisher's private directory ``<root>/asyncrl-w-<pid>-<random>``
(``root`` is ``weights.dir``; mode 0700, so generators run as the learner's user)::

    owner.json       the publishing process (see ``shm_reclaim``)
    announce         ZeroMQ ipc PUB socket: one wake-up message per new version, never data
    v<version>.wts   the newest sealed version (mode 0444; format in ``shm_layout``): the only
                     name subscribers open
    .f<k>            spare files: the version being written, retired versions kept for reuse

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
  one (reused pages are much cheaper to write than fresh tmpfs pages); files still held beyond
  ``_MAX_SPARES`` are unlinked (their memory lives until the holder drops its tensors). Nothing on
  either side blocks on the other; a SIGKILLed subscriber's locks vanish with its fds. A subscriber
  whose file was renamed or reused between its directory scan and its open sees ENOENT, a busy
  lock or a header of another version, and rescans.
- Subscribers map with MAP_PRIVATE (``ACCESS_COPY``): reads share the publisher's page-cache pages,
  a write into a tensor changes only that process's copy of the page, never the file.
- Verification. The publisher hashes the bytes once, from the file itself, after copying
  (``state_dict_checksum``, so ``WeightUpdate.checksum`` means what it means over zmq). A
  subscriber always checks the structure (``shm_layout``), O(tensors), so a truncated or
  mismatched file is rejected; ``verify="full"`` also re-hashes every byte in every subscriber,
  O(bytes) each. The only writer of the file is the publisher, which hashed those very bytes
  before making the file read-only and visible, so re-hashing buys little: the default is
  ``"structure"``, and ``"full"`` is for chasing a suspected corruption. A rejected version is
  logged, counted in ``rejected`` and never retried; the previous version stays current.
- Lifetime. At most one ``v*.wts`` is visible; retired files are renamed away at once and reused
  or unlinked (an unlinked file stays valid while mapped). ``close`` removes the directory, and so
  does normal interpreter exit; a publisher killed by a signal leaves it behind (``shm_reclaim``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import mmap
import os
import shutil
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack
import zmq

from asyncrl.weights import shm_layout as layout
from asyncrl.weights.base import WeightPublisher, WeightSubscriber, check_publish, log, log_rejection
from asyncrl.weights.control_plane import bus_context
from asyncrl.weights.shm_reclaim import DEFAULT_ROOT, DIR_PREFIX, owner_record
from asyncrl.weights.wire import WeightsRejected, WeightUpdate, checksums

if TYPE_CHECKING:
    import torch

SCHEME = "shm://"
# Spare files kept for reuse. Steady state needs one (the live version is the other file); a
# generator that keeps an old version's tensors pins its file, so allow a second before unlinking.
_MAX_SPARES = 2
# A waiting poll rescans the directory at least this often, in case a wake-up was missed (a SUB
# socket that connects just after a PUB send never sees it).
_RESCAN_MS = 100
# Open attempts per poll when files are renamed under the subscriber (each loss means a newer
# version appeared meanwhile, so a few attempts always suffice unless versions arrive every µs).
_OPEN_TRIES = 4


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
        (self.dir / "owner.json").write_text(json.dumps(owner_record(os.getpid())))
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
        entries, buckets, data_end = layout.layout(state_dict, self.bucket_bytes)
        f = self._acquire(data_end)
        try:
            layout.copy_into(f.mm, state_dict, entries, buckets)
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

    # --- the file pool -------------------------------------------------------------------------
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
        f.mm[: layout.HEADER.size] = bytes(layout.HEADER.size)
        return f

    def _spare_name(self) -> str:
        name = f".f{self._next_file}"
        self._next_file += 1
        return name

    def _new_file(self) -> _File:
        name = self._spare_name()
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
        manifest = {
            "version": p.version,
            "tensors": p.entries,
            "buckets": p.buckets,
            "checksum": checksum,
            "created_at": p.created_at,
        }
        layout.seal_file(f.fd, f.mm, msgpack.packb(manifest), p.data_end, p.version)
        os.fchmod(f.fd, 0o444)
        fcntl.flock(f.fd, fcntl.LOCK_UN)  # complete: a reader that opened this inode earlier may read it
        live = layout.live_name(p.version)
        os.rename(self.dir / f.name, self.dir / live)
        f.name = live
        with self._cond:
            old, self._live = self._live, f
            if old is not None:  # retire: out of subscribers' sight at once, kept for reuse
                spare = self._spare_name()
                os.rename(self.dir / old.name, self.dir / spare)
                old.name = spare
                self._add_spare(old)
        with contextlib.suppress(zmq.Again):
            self._pub.send(msgpack.packb(p.version), zmq.NOBLOCK)
        self._stats["versions"] += 1
        self._stats["latest"] = p.version
        self._stats["seal_ms"] = int((time.perf_counter() - t0) * 1000)


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
            "(Docker: --shm-size) or use weights.type=zmq"
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
        found = (layout.LIVE_RE.fullmatch(n) for n in names)
        versions = (int(m[1]) for m in found if m)
        return sorted((v for v in versions if v > self.latest_version and v not in self._bad), reverse=True)

    def _take_newest(self) -> WeightUpdate | None:
        for _ in range(_OPEN_TRIES):
            for version in self._candidates():
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
            fd = os.open(self.dir / layout.live_name(version), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        keep = False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # being rewritten: it is no longer this version
            size = os.fstat(fd).st_size
            header = os.pread(fd, layout.HEADER.size, 0)
            if layout.header_version(header) not in (None, version):
                return None  # reused for a newer version after our scan
            manifest, data_end = layout.read_manifest(fd, header, size, version)
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
            update = layout.build_update(manifest, data_end, mm, self.verify)
            # The shared lock lives as long as the mapping, i.e. as long as any of its tensors.
            weakref.finalize(mm, os.close, fd)
            keep = True
            return update
        finally:
            if not keep:
                os.close(fd)
