"""Delta versions: a version as what changed since the one before it, bit-exact, with the checksum
of the whole result so a subscriber verifies what it applies exactly as it does a full version.

A delta of version ``v`` against base version ``b`` travels as an ordinary wire version (``wire``)
whose payload tensors say what changed and whose manifest carries::

    manifest["delta"] = {"base": b,
                         "base_checksum": str,   # the state checksum the base must have
                         "tensors": [{"name": str, "dtype": str, "shape": [int, ...],
                                      "kind": "same" | "packed" | "full",
                                      "count": int}, ...]}  # packed: how many elements changed
    manifest["checksum"]                         # the state checksum of the payload, as for any version
    manifest["result_checksum"]                  # the state checksum of version v, whole

and the payload holds, per tensor of the result: nothing (``same``: the base's bits); ``<name>@gaps``
(zlib of, for each changed element in order, the number of unchanged ones before it, as little-endian
uint64) and ``<name>@xor`` (zlib of the changed elements' bits XOR the base's, little-endian) (``packed``);
or the tensor under its own name (``full``: when that is smaller, e.g. most elements changed). Elements
compare by their bits (a NaN that stays NaN is unchanged; -0.0 against 0.0 is a change), so applying
the delta to the base reproduces every byte. A full version from a publisher that sends deltas says why
it is not one (``manifest["full_reason"]``).

Why packed: measured on SmolLM2-135M in bfloat16 after AdamW steps at lr 1e-5 (3.5-6.6% of the elements
changed), int32 positions with raw values take 10-20% of the full bytes, 16-bit gaps with values 7-13%,
and zlib's fastest level over the gaps and the XORs (which are mostly a low mantissa bit or two) 3.2-5.7%,
at 0.5-0.8 s of one core for the whole model.

The publisher side (``Deltas``) keeps nothing between versions: the transport hands it the previous
version's snapshot while it still holds it. The subscriber side (``Held``) keeps the tensors of the
version it returned last (views of received frames, or the arrays a delta made), which the next delta
applies to; the tensors of an update are never written to afterwards.

May import: the core.
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from asyncrl.weights.wire import (
    DTYPES,
    Snapshot,
    WeightsRejected,
    WeightUpdate,
    checksums,
    dtype_name,
    seal,
    snapshot,
    state_dict_checksum,
    tensor_views,
)

GAPS, XOR = "@gaps", "@xor"
_GAP = np.dtype("<u8")  # little-endian, as the wire
_LEVEL = 1  # zlib's fastest: the streams are mostly zero bits
# Integer types of the same width as each element size: elements compare and copy by their bits.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclasses.dataclass(frozen=True)
class DeltaPolicy:
    """When a version travels as a delta (``weights.delta``)."""

    full_every: int = 50  # a full version to everyone at least every this many versions (0: never)
    max_ratio: float = 0.5  # a delta only when its payload is at most this fraction of the full version


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(_BITS[t.element_size()])


def delta_tensors(
    base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], budget: float = math.inf
) -> tuple[dict[str, torch.Tensor], list[dict], int] | None:
    """The payload of ``new`` as a delta against ``base``, its result entries, and the number of changed
    elements; None once the payload would exceed ``budget`` bytes (the caller sends the full version)."""
    payload: dict[str, torch.Tensor] = {}
    entries: list[dict] = []
    nbytes = changed = 0
    names = sorted(new)
    comparable = [n for n in names if _comparable(base.get(n), new[n])]
    # zlib and the tensor ops release the GIL: the tensors pack on threads, in order
    packed_all = _threads().map(lambda n: _pack(_bits(base[n]), _bits(new[n])), comparable)
    packs = dict(zip(comparable, packed_all, strict=True))
    for name in names:
        t = new[name]
        entry = {"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "kind": "full"}
        if name in packs:
            packed = packs[name]
            changed += packed[0] if packed else t.numel()
            if packed and packed[0] == 0:
                entry["kind"] = "same"
            elif packed and len(packed[1]) + len(packed[2]) < t.numel() * t.element_size():
                count, gaps, xor = packed
                entry.update(kind="packed", count=count)
                payload[name + GAPS] = torch.frombuffer(bytearray(gaps), dtype=torch.uint8)
                payload[name + XOR] = torch.frombuffer(bytearray(xor), dtype=torch.uint8)
                nbytes += len(gaps) + len(xor)
        else:
            changed += t.numel()
        if entry["kind"] == "full":
            payload[name] = t
            nbytes += t.numel() * t.element_size()
        if nbytes > budget:
            return None
        entries.append(entry)
    return payload, entries, changed


def _comparable(old: torch.Tensor | None, new: torch.Tensor) -> bool:
    return old is not None and old.dtype == new.dtype and old.shape == new.shape and new.numel() > 0


_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool): a forked child makes its own


def _threads() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="delta"))
    return _POOL[1]


def _pack(old: torch.Tensor, new: torch.Tensor) -> tuple[int, bytes, bytes] | None:
    """(changed elements, zlib of the gap before each, zlib of their XOR), or None when most changed."""
    differs = old != new
    count = int(torch.count_nonzero(differs))
    if count > new.numel() // 2:
        return None  # a dense change: the full tensor is smaller
    where = torch.nonzero(differs).reshape(-1).numpy()
    gaps = (np.diff(where, prepend=-1) - 1).astype(_GAP)
    xor = (old.numpy()[where] ^ new.numpy()[where]).astype(old.numpy().dtype.newbyteorder("<"))
    return count, zlib.compress(gaps.tobytes(), _LEVEL), zlib.compress(xor.tobytes(), _LEVEL)


class Deltas:
    """The publisher's side: whether a version goes as a delta against the one before it, and its frames."""

    def __init__(self, policy: DeltaPolicy, bucket_bytes: int) -> None:
        self.policy, self.bucket_bytes = policy, bucket_bytes
        self._since_full = 0  # versions since the last one sent full to everyone
        self.base: tuple[Snapshot, str] | None = None  # the version before (its snapshot and checksum)

    def seal(self, snap: Snapshot) -> tuple[list, tuple[int, list] | None]:
        """``snap``'s full frames (saying why it is not a delta) and, when it goes as one, ``(base version,
        the delta's frames)``; ``snap`` is the next one's base from now on (the caller keeps its buckets
        until then: the previous base's are free once this returns)."""
        sums = checksums(snap.entries, snap.buckets)
        base, self.base = self.base, (snap, sums[1])
        delta, why = self.make(*(base or (None, None)), snap, sums[1])
        if delta is None:
            return seal(snap, {"full_reason": why}, sums), None
        why = f"a delta went to every subscriber that holds version {base[0].version}"
        return seal(snap, {"full_reason": why}, sums), (base[0].version, delta)

    def make(self, base: Snapshot | None, base_checksum: str | None, snap: Snapshot, checksum: str):
        """``(frames, None)``: the sealed delta of ``snap`` (whose state checksum is ``checksum``) against
        ``base``; or ``(None, why)``: send it full, because ``why``."""
        self._since_full += 1
        if base is None or base_checksum is None:
            return self._full("no earlier version")
        if self.policy.full_every and self._since_full >= self.policy.full_every:
            return self._full(f"a full version every {self.policy.full_every}")
        full_bytes = sum(e["nbytes"] for e in snap.entries)
        made = delta_tensors(_tensors(base), _tensors(snap), self.policy.max_ratio * full_bytes)
        if made is None:
            return self._full(f"a delta would carry more than {self.policy.max_ratio:g} of the bytes")
        payload, entries, changed = made
        numel = sum(math.prod(e["shape"]) for e in snap.entries)
        extra = {
            "delta": {"base": base.version, "base_checksum": base_checksum, "tensors": entries},
            "result_checksum": checksum,
            "changed_fraction": changed / max(numel, 1),
            "full_bytes": full_bytes,
        }
        frames = seal(snapshot(snap.version, payload, self.bucket_bytes), extra)
        return frames, None

    def _full(self, why: str):
        self._since_full = 0
        return None, why


def _tensors(snap: Snapshot) -> dict[str, torch.Tensor]:
    return tensor_views(snap.entries, [torch.from_numpy(b) for b in snap.buckets])


class Held:
    """The subscriber's side: the version it returned last, as tensors, and the deltas that apply to it."""

    def __init__(self) -> None:
        self.version = -1  # -1: none (a delta cannot apply until a full version came)
        self.checksum: str | None = None
        self.tensors: dict[str, torch.Tensor] = {}

    def take(self, update: WeightUpdate, manifest: dict) -> WeightUpdate:
        """``update`` (received with ``manifest``) as a full version, a delta applied to the held one; held
        from now on if its publisher sends deltas. Raises ``WeightsRejected`` (and holds what it held) when a
        delta does not apply or its result does not verify."""
        delta = manifest.get("delta")
        if isinstance(delta, dict):
            update = self._apply(update, delta, manifest.get("result_checksum"))
        elif "full_reason" not in manifest:  # a publisher that sends no deltas: nothing to hold for them
            self.version, self.checksum, self.tensors = -1, None, {}
            return update
        self.version, self.checksum, self.tensors = update.version, update.checksum, update.tensors
        return update

    def _apply(self, update: WeightUpdate, delta: dict, result_checksum: str | None) -> WeightUpdate:
        base = delta.get("base")
        if base != self.version or delta.get("base_checksum") != self.checksum:
            raise WeightsRejected(f"a delta against version {base}, and this subscriber holds {self.version}")
        entries = delta.get("tensors")
        if not isinstance(entries, list) or not isinstance(result_checksum, str):
            raise WeightsRejected("delta manifest incomplete")
        payload = update.tensors
        rebuilt = list(_threads().map(lambda e: _rebuild(e, self.tensors, payload), entries))
        tensors = {e["name"]: t for e, t in zip(entries, rebuilt, strict=True)}
        if set(payload) - {e["name"] + x for e in entries for x in ("", GAPS, XOR)}:
            raise WeightsRejected("delta payload holds tensors of no entry")
        if state_dict_checksum(tensors) != result_checksum:
            raise WeightsRejected("state dict checksum mismatch after applying the delta")
        return dataclasses.replace(update, tensors=tensors, checksum=result_checksum, nbytes=_nbytes(tensors))


def _rebuild(e: object, held: dict[str, torch.Tensor], payload: dict[str, torch.Tensor]) -> torch.Tensor:
    """One tensor of a delta's result; raises ``WeightsRejected`` when the entry or payload is malformed."""
    if not isinstance(e, dict) or not isinstance(e.get("name"), str) or e.get("dtype") not in DTYPES:
        raise WeightsRejected(f"bad delta entry {e!r:.80}")
    name, dtype, shape, kind = e["name"], DTYPES[e["dtype"]], e.get("shape"), e.get("kind")
    if not isinstance(shape, list):
        raise WeightsRejected(f"delta entry {name}: bad shape")
    if kind == "full":
        t = payload.get(name)
        if t is None or t.dtype != dtype or list(t.shape) != shape:
            raise WeightsRejected(f"delta entry {name}: full tensor missing or of another kind")
        return t
    old = held.get(name)
    if old is None or old.dtype != dtype or list(old.shape) != shape:
        raise WeightsRejected(f"delta entry {name}: the held version has no such tensor")
    if kind == "same":
        return old
    count = e.get("count")
    if kind != "packed" or not isinstance(count, int) or not 0 < count <= old.numel():
        raise WeightsRejected(f"delta entry {name}: unknown kind {kind!r} or bad count")
    gaps = np.frombuffer(_inflate(name, payload.get(name + GAPS), count * _GAP.itemsize), dtype=_GAP)
    where = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if where[-1] >= old.numel():
        raise WeightsRejected(f"delta entry {name}: position out of range")
    out = old.clone()
    bits = _bits(out).numpy()
    bits[where] ^= np.frombuffer(_inflate(name, payload.get(name + XOR), count * old.element_size()), bits.dtype)
    return out


def _inflate(name: str, packed: torch.Tensor | None, nbytes: int) -> bytes:
    """Exactly ``nbytes`` from the zlib stream ``packed``, or ``WeightsRejected`` (never more: no bomb)."""
    if packed is None or packed.dtype != torch.uint8 or packed.dim() != 1:
        raise WeightsRejected(f"delta entry {name}: packed payload missing or of another type")
    inflate = zlib.decompressobj()
    try:
        data = inflate.decompress(packed.numpy().tobytes(), nbytes)
    except zlib.error as exc:
        raise WeightsRejected(f"delta entry {name}: {exc}") from None
    if len(data) != nbytes or not inflate.eof or inflate.unconsumed_tail:
        raise WeightsRejected(f"delta entry {name}: packed payload of another length")
    return data


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
