"""Trajectory buffers (installed as ``asyncrl.buffers``): the interface, Redis and in-memory backends.

``setup(cfg.buffer, url, prefix)`` is the one way processes get a buffer; see ``base.py`` for the
invariants every backend keeps.

May import: the core.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from asyncrl.buffers.base import STAT_KEYS, Buffer, BufferUnavailableError, DeadLetter, Entry
from asyncrl.buffers.memory import MemoryBuffer
from asyncrl.errors import UserError
from asyncrl.keys import run_prefix

if TYPE_CHECKING:
    from asyncrl.config import BufferConfig

__all__ = [
    "STAT_KEYS",
    "Buffer",
    "BufferUnavailableError",
    "DeadLetter",
    "Entry",
    "MemoryBuffer",
    "run_prefix",
    "setup",
]

_memory_lock = threading.Lock()
_memory_buffers: dict[str, MemoryBuffer] = {}


def setup(cfg_buffer: BufferConfig, url: str | None, prefix: str, retries: int = 10) -> Buffer:
    """The buffer named by ``cfg_buffer.type``.

    redis: connects to ``url`` (else ``cfg_buffer.url``) under ``prefix``; every process of a
    run passes the same URL and prefix; ``retries`` bounds how long a call rides out an outage.
    memory: one buffer per prefix and process, so a generator and a learner running as threads of
    one process share it.
    """
    if cfg_buffer.type == "memory":
        with _memory_lock:
            return _memory_buffers.setdefault(prefix, MemoryBuffer())
    if cfg_buffer.type == "redis":
        url = url or cfg_buffer.url
        if not url:
            raise UserError("buffer.type=redis needs a Redis URL (buffer.url or --redis-url)")
        from asyncrl.buffers.redis_buffer import RedisBuffer

        return RedisBuffer(url, prefix, retries=retries)
    raise UserError(f"unknown buffer type {cfg_buffer.type!r}")
