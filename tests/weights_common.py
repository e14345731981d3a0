"""Helpers the weight-bus tests share: raw bytes, every-bit-pattern tensors, bit-exact comparison,
and an in-memory bus that delivers hand-made frames."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from asyncrl.weights.memory import MemoryWeightBus


def raw(t: torch.Tensor) -> bytes:
    """The tensor's bytes (copied to the host first if it lives on a device)."""
    t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Every bit pattern (NaN payloads, infinities, subnormals) for float dtypes."""
    t = torch.empty(shape, dtype=dtype)
    if t.numel():
        flat = t.reshape(-1).view(torch.uint8).numpy()
        flat[:] = np.random.default_rng(seed).integers(0, 256, flat.size, np.uint8)
    return t


def assert_bit_equal(got: dict, want: dict, device: str = "cpu") -> None:
    """Same names, dtypes, shapes and bits, and every received tensor on ``device``."""
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert got[name].device == torch.device(device), name
        assert raw(got[name]) == raw(t), name


class InjectingBus(MemoryWeightBus):
    """The in-memory bus with a seam for tests: ``inject`` delivers raw frames (hand-made or
    corrupted versions) to every subscriber, as a misbehaving publisher would."""

    def inject(self, frames: Sequence) -> None:
        with self._cond:
            for sub in self._subscribers:
                sub._inbox.append(list(frames))
            self._cond.notify_all()
