"""Helpers the generator tests share: the untrained demo model on disk, and a Generator around an
engine with everything else in memory or on the test's Redis."""

from __future__ import annotations

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

    from asyncrl.generators.worker import Generator

    return Generator(
        cfg.generator,
        cfg.data,
        cfg.run,
        cfg.learner.groups_per_step,
        ident="0",
        engine=engine,
        buffer=buffer if buffer is not None else MemoryBuffer(),
        control=control,
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        subscriber=subscriber,
    )
