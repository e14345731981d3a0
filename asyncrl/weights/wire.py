"""Wire format of the weight bus: one policy version as a list of frames. Never pickle.

A version travels as one multipart message::

    [b"asyncrl.weights/2", manifest_msgpack, bucket_0, ..., bucket_{m-1}]

    manifest = {"version": int,                     # policy version (learner optimizer steps)
                "tensors": [{"name": str, "dtype": str,   # "float32", "bfloat16", "int64", ...
                             "shape": [int, ...],
                             "bucket": int,          # index of the bucket frame holding the bytes
                             "offset": int,          # byte offset in that bucket (multiple of 64)
                             "nbytes": int}, ...],   # == prod(shape) * itemsize
                "buckets": [{"nbytes": int, "checksum": str}, ...],
                "checksum": str,                     # state_dict_checksum of the whole version
                "created_at": float}                 # publisher wall clock (latency metrics only)

Tensors are packed in sorted-name order, little-endian raw bytes (bfloat16 as its raw 2-byte
values), into buckets of at most ``bucket_bytes``; a tensor larger than a bucket gets a bucket of
its own. Padding between tensors is zero bytes. Every tensor's bytes are hashed once, with
xxh3-128 (``tensor_digest``); a bucket's ``checksum`` is xxh3-128 hex over the digests of the
tensors it holds, and the whole ``checksum`` is ``combine_digests`` over all of them in sorted-name
order, which equals ``state_dict_checksum`` of the state dict (independent of the bucket size, so
both ends of any transport can compare it). One pass over the bytes on each side verifies both.

``decode`` verifies everything (header, manifest schema, bucket count and sizes, bucket checksums,
tensor extents, whole checksum) before building a single tensor (each a zero-copy view of a
received frame): a version is either complete and verified or rejected with ``WeightsRejected``
naming the reason.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import torch
import xxhash

WIRE_HEADER = b"asyncrl.weights/2"
# Tensor offsets inside a bucket are multiples of this (a cache line, and AVX-512 width), so a
# receiver that maps a bucket in place gets aligned tensors.
ALIGN = 64

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if hasattr(torch, name)
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class WeightsRejected(ValueError):
    """A received version that does not verify; the message is the reason."""


@dataclasses.dataclass
class WeightUpdate:
    """One complete, verified policy version as CPU tensors (names as published)."""

    version: int
    tensors: dict[str, torch.Tensor]
    checksum: str  # state_dict_checksum(tensors)
    nbytes: int  # payload bytes (sum of tensor nbytes)
    received_at: float  # time.time() when the subscriber took it off the wire
    published_at: float = 0.0  # publisher's time.time() when it serialised the version
    # What crossed the wire, for the record: "kind" ("full" or "delta"), "bytes" (its payload),
    # "full_reason" (a full one: why not a delta), "changed_fraction" (a delta: of the elements).
    sent: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Snapshot:
    """A version copied out of the caller's tensors into private buckets (checksums not yet done)."""

    version: int
    entries: list[dict]  # manifest "tensors" entries, sorted by name
    buckets: list[np.ndarray]  # uint8 (nbytes,) each
    created_at: float


_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool): a forked child makes its own
_POOL_LOCK = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    """Threads for hashing large tensors (xxhash releases the GIL while it hashes)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            workers = min(4, os.cpu_count() or 1)
            _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weights-hash"))
        return _POOL[1]


def tensor_digest(data) -> bytes:
    """xxh3-128 of one tensor's raw bytes (a fast non-cryptographic hash). It guards against
    corruption and truncation, not against an adversary: over tcp that is CURVE's job (``curve``)."""
    return xxhash.xxh3_128_digest(data)


def tensor_digests(views: Sequence) -> list[bytes]:
    """Digests of many byte views: large ones on the pool's threads, small ones inline."""
    large = {i for i, v in enumerate(views) if memoryview(v).nbytes >= _PARALLEL_BYTES}
    futures = {i: _hash_pool().submit(tensor_digest, views[i]) for i in sorted(large)}
    return [futures[i].result() if i in large else tensor_digest(v) for i, v in enumerate(views)]


# Tensors at least this large are hashed on the thread pool (below it, handing off costs more).
_PARALLEL_BYTES = 4 << 20


def combine_digests(items: Iterable[tuple[str, str, Sequence[int], bytes]]) -> str:
    """The state checksum from per-tensor digests: xxh3-128 hex over msgpack([name, dtype, shape])
    and the tensor's digest, for every tensor in sorted-name order."""
    h = xxhash.xxh3_128()
    for name, dtype, shape, d in items:
        h.update(msgpack.packb([name, dtype, [int(s) for s in shape]]))
        h.update(d)
    return h.hexdigest()


def checksums(entries: list[dict], buckets: Sequence) -> tuple[list[str], str]:
    """Per-bucket checksums and the state checksum of a planned version, reading every byte once.

    A bucket's checksum is xxh3-128 hex over the digests of the tensors it holds, in manifest order
    (padding is not covered: it carries no data). ``entries`` must be in sorted-name order.
    """
    digests = tensor_digests([tensor_view(e, buckets) for e in entries])
    per_bucket = [xxhash.xxh3_128() for _ in buckets]
    for e, d in zip(entries, digests, strict=True):
        if e["nbytes"]:
            per_bucket[e["bucket"]].update(d)
    whole = combine_digests((e["name"], e["dtype"], e["shape"], d) for e, d in zip(entries, digests, strict=True))
    return [h.hexdigest() for h in per_bucket], whole


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"weight bus cannot carry dtype {dtype}") from None


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a uint8 numpy view (a CPU copy only when the tensor is not on CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return np.empty(0, np.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def state_dict_checksum(state_dict: dict[str, torch.Tensor]) -> str:
    """The state checksum of a state dict (what the manifest's ``checksum`` carries).

    Equal checksums mean equal names, dtypes, shapes and bits (NaN payloads included); the order
    in which the dict was built and the bucket size do not matter.
    """
    names = sorted(state_dict)
    digests = tensor_digests([_raw_bytes(state_dict[n]) for n in names])
    return combine_digests(
        (n, dtype_name(state_dict[n].dtype), state_dict[n].shape, d) for n, d in zip(names, digests, strict=True)
    )


def plan(state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[list[dict], list[int]]:
    entries: list[dict] = []
    sizes: list[int] = []
    for name in sorted(state_dict):
        t = state_dict[name]
        nbytes = t.numel() * t.element_size()
        offset = -(-sizes[-1] // ALIGN) * ALIGN if sizes else 0
        if not sizes or (sizes[-1] > 0 and offset + nbytes > bucket_bytes):
            sizes.append(0)
            offset = 0
        sizes[-1] = offset + nbytes
        entries.append(
            {
                "name": name,
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "bucket": len(sizes) - 1,
                "offset": offset,
                "nbytes": nbytes,
            }
        )
    return entries, sizes


class BucketPool:
    """Bucket arrays kept for the next versions: a fresh allocation costs several times its copy in
    page faults. A set is reused once its ``free()`` says no reader holds it any more."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._sets: list[tuple[list[np.ndarray], Callable[[], bool]]] = []
        self._lock = threading.Lock()
        self.reused = 0  # takes served from the pool

    def take(self, sizes: list[int]) -> list[np.ndarray]:
        with self._lock:
            for i, (arrays, free) in enumerate(self._sets):
                if [a.nbytes for a in arrays] == sizes and free():
                    del self._sets[i]
                    self.reused += 1
                    return arrays
        return [np.empty(n, np.uint8) for n in sizes]

    def give(self, arrays: list[np.ndarray], free: Callable[[], bool] = lambda: True) -> None:
        with self._lock:
            self._sets.append((arrays, free))
            del self._sets[: -self.keep]  # the oldest go (freed by their last reader)


def snapshot(
    version: int, state_dict: dict[str, torch.Tensor], bucket_bytes: int, pool: BucketPool | None = None
) -> Snapshot:
    """Copy ``state_dict`` into buckets (from ``pool`` if given): afterwards the caller may change
    its tensors."""
    if not all(isinstance(k, str) for k in state_dict):
        raise TypeError("state dict names must be strings")
    entries, sizes = plan(state_dict, bucket_bytes)
    buckets = pool.take(sizes) if pool is not None else [np.empty(n, np.uint8) for n in sizes]
    ends = [0] * len(buckets)  # zero the padding in front of each tensor: buckets may be reused
    for e in entries:
        if e["nbytes"]:
            bucket = buckets[e["bucket"]]
            bucket[ends[e["bucket"]] : e["offset"]] = 0
            src = state_dict[e["name"]].detach().reshape(-1).view(torch.uint8)
            torch.from_numpy(bucket)[e["offset"] : e["offset"] + e["nbytes"]].copy_(src)  # also from GPU
            ends[e["bucket"]] = e["offset"] + e["nbytes"]
    return Snapshot(int(version), entries, buckets, time.time())


def seal(snap: Snapshot, extra: dict | None = None, sums: tuple[list[str], str] | None = None) -> list:
    """Checksum a snapshot and return its frames (the bucket frames are the snapshot's arrays);
    ``extra``: more manifest fields (a delta's, see ``delta``); ``sums``: its ``checksums``, if known."""
    bucket_sums, whole = sums or checksums(snap.entries, snap.buckets)
    manifest = {
        **(extra or {}),
        "version": snap.version,
        "tensors": snap.entries,
        "buckets": [{"nbytes": int(b.nbytes), "checksum": c} for b, c in zip(snap.buckets, bucket_sums, strict=True)],
        "checksum": whole,
        "created_at": snap.created_at,
    }
    return [WIRE_HEADER, msgpack.packb(manifest), *snap.buckets]


def encode(version: int, state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> list:
    """The frames of one version (``snapshot`` + ``seal``), in one go."""
    return seal(snapshot(version, state_dict, bucket_bytes))


def as_buffer(frame) -> memoryview:
    """A flat byte view of a frame: bytes, numpy array, or zmq.Frame (its ``.buffer``)."""
    return memoryview(getattr(frame, "buffer", frame)).cast("B")


def peek_version(frames: Sequence) -> tuple[int, dict]:
    """Header and manifest only (cheap): the version and the decoded manifest."""
    if len(frames) < 2:
        raise WeightsRejected(f"message has {len(frames)} frames, need header and manifest")
    if bytes(as_buffer(frames[0])) != WIRE_HEADER:
        raise WeightsRejected(f"unknown header {bytes(as_buffer(frames[0]))[:40]!r}")
    try:
        manifest = msgpack.unpackb(as_buffer(frames[1]))
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a rejection
        raise WeightsRejected(f"manifest is not msgpack: {exc}") from None
    if not isinstance(manifest, dict):
        raise WeightsRejected("manifest is not a map")
    for key, typ in (("version", int), ("tensors", list), ("buckets", list), ("checksum", str)):
        if not isinstance(manifest.get(key), typ):
            raise WeightsRejected(f"manifest field {key!r} missing or not {typ.__name__}")
    return manifest["version"], manifest


def _check_sizes(manifest: dict, buckets: list[memoryview]) -> None:
    if len(buckets) != len(manifest["buckets"]):
        raise WeightsRejected(f"{len(buckets)} bucket frames, manifest lists {len(manifest['buckets'])}")
    for i, (meta, buf) in enumerate(zip(manifest["buckets"], buckets, strict=True)):
        if not isinstance(meta, dict) or meta.get("nbytes") != buf.nbytes:
            raise WeightsRejected(f"bucket {i}: {buf.nbytes} bytes received, manifest says {meta!r:.80}")


def check_entries(tensors: object, bucket_sizes: list[int]) -> None:
    """Every manifest tensor entry well formed (unique name, known dtype, shape matching nbytes) and
    inside its bucket at a multiple of ``ALIGN``; raises ``WeightsRejected``. Every transport's check."""
    if not isinstance(tensors, list):
        raise WeightsRejected("manifest tensors is not a list")
    seen: set[str] = set()
    for e in tensors:
        if not isinstance(e, dict):
            raise WeightsRejected("tensor entry is not a map")
        name, dtype, shape = e.get("name"), e.get("dtype"), e.get("shape")
        if not isinstance(name, str) or name in seen:
            raise WeightsRejected(f"tensor name {name!r} missing or repeated")
        seen.add(name)
        if dtype not in DTYPES:
            raise WeightsRejected(f"tensor {name}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise WeightsRejected(f"tensor {name}: bad shape {shape!r}")
        bucket, offset, nbytes = e.get("bucket"), e.get("offset"), e.get("nbytes")
        if nbytes != math.prod(shape) * DTYPES[dtype].itemsize:
            raise WeightsRejected(f"tensor {name}: nbytes {nbytes!r} does not match {dtype}{shape}")
        if not nbytes:
            continue
        if not (isinstance(bucket, int) and 0 <= bucket < len(bucket_sizes)):
            raise WeightsRejected(f"tensor {name}: bucket {bucket!r} out of range")
        if not (isinstance(offset, int) and offset >= 0 and offset % ALIGN == 0):
            raise WeightsRejected(f"tensor {name}: bad offset {offset!r}")
        if offset + nbytes > bucket_sizes[bucket]:
            raise WeightsRejected(f"tensor {name}: bytes [{offset}, +{nbytes}) outside bucket {bucket}")


def tensor_view(e: dict, buckets: list[memoryview]) -> memoryview:
    if not e["nbytes"]:
        return memoryview(b"")
    return buckets[e["bucket"]][e["offset"] : e["offset"] + e["nbytes"]]


def flat_tensor(buf: memoryview) -> torch.Tensor:
    """A uint8 tensor over ``buf`` without copying; it keeps the buffer alive. Received frames are
    read-only buffers: the tensors over them must not be written to (engines copy them in)."""
    if not buf.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=torch.uint8)


def tensor_views(entries: list[dict], buckets: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The version's tensors as zero-copy views of its (flat uint8) bucket tensors, by name."""
    tensors: dict[str, torch.Tensor] = {}
    for e in entries:
        dtype = DTYPES[e["dtype"]]
        if e["nbytes"]:
            start = e["offset"]
            tensors[e["name"]] = buckets[e["bucket"]][start : start + e["nbytes"]].view(dtype).view(e["shape"])
        else:
            tensors[e["name"]] = torch.empty(e["shape"], dtype=dtype)
    return tensors


def decode(frames: Sequence, manifest: dict | None = None) -> WeightUpdate:
    """Verify a received message and build its CPU tensors; raises ``WeightsRejected``."""
    if manifest is None:
        _, manifest = peek_version(frames)
    buckets = [as_buffer(f) for f in frames[2:]]
    _check_sizes(manifest, buckets)
    check_entries(manifest["tensors"], [b.nbytes for b in buckets])
    entries = sorted(manifest["tensors"], key=lambda e: e["name"])
    bucket_sums, checksum = checksums(entries, buckets)
    for i, (meta, got) in enumerate(zip(manifest["buckets"], bucket_sums, strict=True)):
        if got != meta.get("checksum"):
            raise WeightsRejected(f"bucket {i}: checksum mismatch")
    if checksum != manifest["checksum"]:
        raise WeightsRejected("state dict checksum mismatch")
    tensors = tensor_views(entries, [flat_tensor(b) for b in buckets])
    nbytes = sum(e["nbytes"] for e in entries)
    return WeightUpdate(
        version=manifest["version"],
        tensors=tensors,
        checksum=checksum,
        nbytes=nbytes,
        received_at=time.time(),
        published_at=float(manifest.get("created_at", 0.0) or 0.0),
        sent=sent_record(manifest, nbytes),
    )


def sent_record(manifest: dict, nbytes: int) -> dict:
    """What a version's manifest says about how it travelled (``WeightUpdate.sent``)."""
    if isinstance(manifest.get("delta"), dict):
        return {"kind": "delta", "bytes": nbytes, "changed_fraction": manifest.get("changed_fraction")}
    return {"kind": "full", "bytes": nbytes, "full_reason": manifest.get("full_reason")}
