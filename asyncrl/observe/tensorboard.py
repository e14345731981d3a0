"""TensorBoard event files without TensorFlow: scalars only, written by the launcher.

An event file is a sequence of TFRecords (little-endian ``uint64`` length, masked crc32c of the length,
the data, masked crc32c of the data) around ``Event`` protobufs: ``wall_time`` (double, field 1),
``step`` (int64, field 2), ``file_version`` (string, field 3; the first event only) and ``summary``
(field 5) = ``Summary { repeated Value value = 1 { string tag = 1; float simple_value = 2 } }``.

Each writer makes a new file (``events.out.tfevents.<unix time>.<host>.<pid>.<n>``) and only appends
to it, so a resumed run adds a file next to the old one and never rewrites a byte of it; TensorBoard
reads a directory's files in name order.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli, reflected
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's mask: a CRC of data holding CRCs would otherwise be weak."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def _varint(n: int) -> bytes:
    n &= 0xFFFFFFFFFFFFFFFF  # int64 as protobuf writes it: a negative number takes ten bytes
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | 0x80 if n else byte)
        if not n:
            return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int = 0, scalars: dict[str, float] | None = None, file_version: str = "") -> bytes:
    """One serialized ``Event``."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3 | 0) + _varint(step)
    if file_version:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", _f32(v)))
            for tag, v in scalars.items()
        )
        out += _bytes_field(5, values)
    return out


def _f32(v: float) -> float:
    """``v`` as a float32 holds it: beyond its range it is an infinity (struct would raise)."""
    if math.isfinite(v) and abs(v) > 3.4028234663852886e38:
        return math.copysign(math.inf, v)
    return v


class EventWriter:
    """Appends scalar events to a new file in ``logdir``; every event is flushed (the launcher may be
    killed at any moment: at worst the last record is torn, which readers skip)."""

    _serial = itertools.count()

    def __init__(self, logdir: str | Path):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(self._serial)}"
        self.path = self.logdir / name
        self._f = self.path.open("xb")  # never an existing file
        self._f.write(tfrecord(event(time.time(), file_version="brain.Event:2")))
        self._f.flush()

    def scalars(self, step: int, values: dict[str, float], wall_time: float) -> None:
        if values:
            self._f.write(tfrecord(event(wall_time, step, values)))
            self._f.flush()

    def close(self) -> None:
        self._f.close()
