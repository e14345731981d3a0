"""Helpers the generator tests share: the untrained demo model on disk, a Generator around an
engine with everything else in memory or on the test's Redis, and ways to drive it a step at a time."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from asyncrl.buffers import MemoryBuffer
from asyncrl.demo.model import build_model, build_tokenizer


def save_tiny_model(path: Path) -> Path:
    """The demo's byte tokenizer and an untrained demo-sized Llama (seed 0), saved as an HF directory."""
    tok = build_tokenizer()
    build_model(tok, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_generator(cfg, engine, control, subscriber, model_dir, buffer=None):
    """A Generator of ``cfg`` around ``engine`` (id "0"), on ``buffer`` (default: a MemoryBuffer)."""
    from transformers import AutoTokenizer

    from asyncrl.generators.generator import Generator

    return Generator(
        cfg,
        ident="0",
        engine=engine,
        buffer=buffer if buffer is not None else MemoryBuffer(),
        control=control,
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        subscriber=subscriber,
    )


def apply_newest(gen, timeout_s: float = 10.0) -> bool:
    """Load the newest version the generator's weight feed has (waiting up to ``timeout_s``), as the
    pump does between steps when no turn is running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        update = gen.feed.newer(timeout_ms=100)
        if update is not None:
            gen.engine.load_weights(update.tensors)
            gen.feed.applied(update, 0.0)
            return True
    return False


def play_groups(gen, seqs: list[int]) -> None:
    """Run the groups of the claimed sequence numbers ``seqs`` to their end (pushed, failed or
    abandoned), as the generator's loop runs the groups it admits, with its engine pump."""

    async def play():
        pump = asyncio.create_task(gen.pump.run())
        tasks = [asyncio.create_task(gen.run_group(seq)) for seq in seqs]
        gen.groups.update(tasks)
        try:
            await asyncio.gather(*tasks)
        finally:
            gen.groups.difference_update(tasks)
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)

    asyncio.run(play())
