"""Prompt datasets, user code named by import path, and how that code is called."""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from asyncrl.errors import UserError

RewardFn = Callable[[str, str, dict], float]  # (prompt, completion text, record) -> reward


def load_jsonl(path: str | Path) -> list[dict]:
    """Records with a ``prompt`` string or a chat ``messages`` list (see :func:`prompt_of`); errors name
    the file and line."""
    records = [rec for _, rec in numbered_jsonl(path)]
    if not records:
        raise UserError(f"dataset file is empty: {path}")
    return records


def numbered_jsonl(path: str | Path, problem: Callable[[object], str | None] | None = None) -> list[tuple[int, dict]]:
    """``(line number, record)`` of every non-blank line; errors name the file and line. ``problem``: what
    is wrong with one record, or None (default: a prompt dataset's rule)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"dataset file not found: {path}")
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        wrong = (problem or _record_problem)(rec)
        if wrong:
            raise UserError(f"{path}:{lineno}: {wrong}")
        records.append((lineno, rec))
    return records


def prompt_of(record: dict) -> str | list[dict]:
    """A record's prompt: its ``prompt`` string, or its ``messages``, a chat of ``{"role", "content"}``
    objects that the tokenizer's chat template renders (ending with a generation prompt)."""
    return record["prompt"] if "prompt" in record else record["messages"]


def _record_problem(rec: object) -> str | None:
    """What is wrong with one dataset line, or None."""
    if not isinstance(rec, dict) or ("prompt" in rec) == ("messages" in rec):
        return "each line must be an object with a string 'prompt' or a list of chat 'messages'"
    if "prompt" in rec:
        return None if isinstance(rec["prompt"], str) else "'prompt' must be a string"
    messages = rec["messages"]
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {'role': ..., 'content': ...} objects"
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"messages[{i}] must be an object with string 'role' and 'content'"
    if messages[-1]["role"] == "assistant":
        return "the last message is the assistant's: the model has nothing to answer"
    return None


def import_by_path(spec: str) -> Callable:
    """``'package.module:function'`` -> the function."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        raise UserError(f"{spec!r} is not of the form 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"cannot import {spec!r}: {exc}") from None
    except SyntaxError as exc:
        raise UserError(f"cannot import {spec!r}: {exc.filename}:{exc.lineno}: SyntaxError: {exc.msg}") from None
    except Exception as exc:  # noqa: BLE001 - any error at import time is the user's module's
        raise UserError(f"cannot import {spec!r}: importing {module_name} raised {type(exc).__name__}: {exc}") from None
    try:
        fn = getattr(module, attr)
    except AttributeError as exc:
        raise UserError(f"cannot import {spec!r}: {exc}") from None
    if not callable(fn):
        raise UserError(f"{spec!r} is not callable")
    return fn


def is_async(fn: Callable) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one (a remote reward)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


async def call_bounded(fn: Callable, timeout_s: float, *args, **kwargs):
    """``fn(*args, **kwargs)`` within ``timeout_s`` (``TimeoutError`` past it): awaited if async, else
    on a worker thread, so plain user code never blocks the event loop. A thread cannot be killed:
    one that never returns keeps its thread after the timeout fired."""
    if is_async(fn):
        return await asyncio.wait_for(fn(*args, **kwargs), timeout_s)
    return await asyncio.wait_for(asyncio.to_thread(fn, *args, **kwargs), timeout_s)


def prompt_for_sequence(seq: int, num_prompts: int, seed: int) -> tuple[int, int]:
    """Group sequence number -> (epoch, prompt index).

    The buffer hands out sequence numbers 0, 1, 2, ... exactly once across all generators; each
    epoch is a fresh seeded permutation, so every prompt is claimed once per epoch.
    """
    epoch, pos = divmod(seq, num_prompts)
    return epoch, int(_epoch_order(num_prompts, seed, epoch)[pos])


@functools.lru_cache(maxsize=4)
def _epoch_order(num_prompts: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_prompts)
