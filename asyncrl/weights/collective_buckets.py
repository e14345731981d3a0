"""What the collective bus moves: a version as flat uint8 buckets on the device, their checksums,
and the checks a subscriber runs before it builds a single tensor.

A bucket holds the tensors of ``wire.plan`` at their planned offsets and is padded with zeros to a
multiple of ``ALIGN`` bytes, so it is a whole number of int32 words. Its checksum is two wrapping
int64 sums over those words w_i, sum(w_i) and sum((i+1) * w_i), computed where the bucket lives, so
GPU bytes are never copied to the host. It catches any change confined to one word, swapped or
shifted words (almost surely), and any size change (sizes are checked separately); it is an
integrity check for the transport, not a cryptographic one (a forger, or errors that cancel in both
sums, pass). ``WeightUpdate.checksum`` of this bus is ``digest`` of the manifest and bucket sums,
not ``state_dict_checksum`` (which would need every byte on the host).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time

import msgpack
import torch

from asyncrl.weights.wire import ALIGN, DTYPES, WeightsRejected, WeightUpdate, check_entries, plan

# int32 words per checksum step: bounds the device scratch memory to ~3 x 32 MiB per step.
_CHUNK_WORDS = 1 << 22
_MASK = (1 << 64) - 1


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def bucket_checksums(buckets: list[torch.Tensor]) -> list[str]:
    """Per bucket (uint8, length a multiple of 4): hex of sum(w_i) and sum((i+1) w_i) mod 2**64
    over its int32 words, computed where the bucket lives; one 16-byte transfer per bucket."""
    sums = []
    for bucket in buckets:
        words = bucket.view(torch.int32)
        acc = torch.zeros(2, dtype=torch.int64, device=bucket.device)
        for start in range(0, words.numel(), _CHUNK_WORDS):
            w = words[start : start + _CHUNK_WORDS].to(torch.int64)
            pos = torch.arange(start + 1, start + 1 + w.numel(), dtype=torch.int64, device=bucket.device)
            acc[0] += w.sum()
            acc[1] += (w * pos).sum()  # wraps mod 2**64, identically on every device
        sums.append(acc)
    host = torch.stack(sums).cpu().tolist() if sums else []
    return [f"{s & _MASK:016x}{p & _MASK:016x}" for s, p in host]


def digest(manifest: dict) -> str:
    """``WeightUpdate.checksum`` of this bus: blake2b-128 over the tensor entries and bucket sums."""
    body = [manifest["tensors"], [b["checksum"] for b in manifest["buckets"]]]
    return hashlib.blake2b(msgpack.packb(body), digest_size=16).hexdigest()


@dataclasses.dataclass
class DeviceSnapshot:
    version: int
    entries: list[dict]
    sizes: list[int]  # unpadded bucket sizes, as planned
    buckets: list[torch.Tensor]  # uint8 (padded(size),) on the device
    copied: torch.cuda.Event | None  # recorded after the copies (CUDA only)
    created_at: float


def device_snapshot(version: int, state_dict: dict[str, torch.Tensor], bucket_bytes: int, device) -> DeviceSnapshot:
    """Copy ``state_dict`` into fresh buckets on ``device``; on CUDA the copies are only queued
    (wait on ``copied`` before reading the buckets from another stream or thread)."""
    if not all(isinstance(k, str) for k in state_dict):
        raise TypeError("state dict names must be strings")
    device = torch.device(device)
    entries, sizes = plan(state_dict, bucket_bytes)
    buckets = [torch.zeros(padded(n), dtype=torch.uint8, device=device) for n in sizes]
    for e in entries:
        if e["nbytes"]:
            src = state_dict[e["name"]].detach().reshape(-1).view(torch.uint8)
            buckets[e["bucket"]][e["offset"] : e["offset"] + e["nbytes"]].copy_(src)
    copied = None
    if device.type == "cuda":
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(device))
    return DeviceSnapshot(int(version), entries, sizes, buckets, copied, time.time())


def manifest_of(snap: DeviceSnapshot, epoch: int, sums: list[str]) -> dict:
    """The ``version`` control message of ``snap`` (see ``collective_bus``)."""
    return {
        "epoch": epoch,
        "version": snap.version,
        "created_at": snap.created_at,
        "tensors": snap.entries,
        "buckets": [{"nbytes": n, "checksum": c} for n, c in zip(snap.sizes, sums, strict=True)],
    }


def check_manifest(m: object) -> list[int]:
    """The padded bucket sizes to receive; raises ``WeightsRejected`` if even those are unclear."""
    if not isinstance(m, dict):
        raise WeightsRejected("manifest is not a map")
    for key, typ in (("version", int), ("epoch", int), ("tensors", list), ("buckets", list)):
        if not isinstance(m.get(key), typ):
            raise WeightsRejected(f"manifest field {key!r} missing or not {typ.__name__}")
    for i, b in enumerate(m["buckets"]):
        if not (isinstance(b, dict) and isinstance(b.get("nbytes"), int) and b["nbytes"] >= 0):
            raise WeightsRejected(f"bucket {i}: bad entry {b!r:.80}")
        if not isinstance(b.get("checksum"), str):
            raise WeightsRejected(f"bucket {i}: checksum missing")
    return [padded(b["nbytes"]) for b in m["buckets"]]


def build_update(m: dict, buckets: list[torch.Tensor], device: torch.device) -> WeightUpdate:
    """Verify received buckets against the manifest (entries, then checksums); the tensors are
    views of the buckets, on the device."""
    check_entries(m["tensors"], [b["nbytes"] for b in m["buckets"]])
    for i, (meta, got) in enumerate(zip(m["buckets"], bucket_checksums(buckets), strict=True)):
        if got != meta["checksum"]:
            raise WeightsRejected(f"bucket {i}: checksum mismatch")
    tensors = {}
    for e in m["tensors"]:
        dtype, (b, off, n) = DTYPES[e["dtype"]], (e["bucket"], e["offset"], e["nbytes"])
        if n:
            tensors[e["name"]] = buckets[b][off : off + n].view(dtype).view(e["shape"])
        else:
            tensors[e["name"]] = torch.empty(e["shape"], dtype=dtype, device=device)
    return WeightUpdate(
        version=m["version"],
        tensors=tensors,
        checksum=digest(m),
        nbytes=sum(e["nbytes"] for e in m["tensors"]),
        received_at=time.time(),
        published_at=float(m.get("created_at", 0.0) or 0.0),
    )
