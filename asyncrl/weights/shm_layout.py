"""The shm bus's version file: how a version is laid out, written and read back. Little-endian;
no pickle::

    [0, 64)          header: magic b"asyncrl.shmw/2\\0\\0", u64 manifest_offset, u64 manifest_nbytes,
                     16-byte xxh3-128 of the manifest, u64 version, u64 file_nbytes
    [4096, ...)      buckets, each page-aligned; inside a bucket tensors sit at multiples of 64
                     (the bucket plan of ``asyncrl.weights.wire``)
    [manifest_offset, file_nbytes)  msgpack manifest: the wire manifest, except that "buckets" are
                     [{"offset": file offset, "nbytes": int}] and only the whole "checksum"
                     (``state_dict_checksum``) is carried

The header is written last, after the manifest (an all-zero header means "being written"), and the
file is renamed to ``v<version>.wts`` only once complete. A reader checks what is O(tensors):
header, manifest digest and schema, file size, bucket and tensor extents, dtype/shape/nbytes
agreement; under ``verify="full"`` it also re-hashes every byte against the manifest's checksum.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import time
from typing import TYPE_CHECKING

import numpy as np

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

if TYPE_CHECKING:
    import torch

MAGIC = b"asyncrl.shmw/2\0\0"
HEADER = struct.Struct("<16sQQ16sQQ")  # magic, manifest offset, manifest nbytes, digest, version, file nbytes
DATA_START = 4096  # buckets start on a page: the header never shares a page with tensor bytes
PAGE = 4096
LIVE_RE = re.compile(r"v(\d+)\.wts")


def live_name(version: int) -> str:
    """The name under which a complete version is visible."""
    return f"v{version}.wts"


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def layout(state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[list[dict], list[dict], int]:
    """Manifest tensor entries, bucket placement in the file, and the end of the data region."""
    if not all(isinstance(k, str) for k in state_dict):
        raise TypeError("state dict names must be strings")
    entries, sizes = plan(state_dict, bucket_bytes)
    buckets, offset = [], DATA_START
    for n in sizes:
        buckets.append({"offset": offset, "nbytes": n})
        offset = _align(offset + n, PAGE)
    return entries, buckets, max(offset, DATA_START)


def copy_into(mm: mmap.mmap, state_dict: dict, entries: list[dict], buckets: list[dict]) -> None:
    """Each tensor's bytes to its place in the mapping (also from GPU).

    CPU tensors are copied by numpy, one thread: torch's copy runs an OpenMP region per tensor, and
    on a busy machine (a learner's own threads, other processes) each region waits for its slowest
    thread to be scheduled (docs/architecture.md has the measurement).
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


def seal_file(fd: int, mm: mmap.mmap, manifest: bytes, data_end: int, version: int) -> None:
    """Append ``manifest`` after the data region, then write the header: the file is complete."""
    moff = _align(data_end, ALIGN)
    end = moff + len(manifest)
    os.ftruncate(fd, end)
    os.pwrite(fd, manifest, moff)
    mm[: HEADER.size] = HEADER.pack(MAGIC, moff, len(manifest), tensor_digest(manifest), version, end)


def header_version(header: bytes) -> int | None:
    """The version a complete header names; None for a short, void or foreign header."""
    if len(header) != HEADER.size or header[:16] != MAGIC:
        return None
    return HEADER.unpack(header)[4]


def read_manifest(fd: int, header: bytes, size: int, version: int) -> tuple[dict, int]:
    """The verified manifest and where it starts (the end of the data region)."""
    if len(header) != HEADER.size:
        raise WeightsRejected(f"file of {size} bytes has no header")
    magic, moff, mlen, digest, hversion, end = HEADER.unpack(header)
    if magic != MAGIC:
        raise WeightsRejected(f"unknown file magic {magic!r}")
    if end != size:
        raise WeightsRejected(f"file has {size} bytes, header says {end}")
    if not DATA_START <= moff <= moff + mlen == end:
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
        if not DATA_START <= off <= off + n <= data_end:
            raise WeightsRejected(f"bucket {i}: bytes [{off}, +{n}) outside the data region")
        views.append(data[off : off + n])
    return views


def build_update(manifest: dict, data_end: int, mm: mmap.mmap, verify: str) -> WeightUpdate:
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
