"""Prompt records (their images too), user code named by import path, and how that code is called. Where the
records come from, files and datasets and mixtures of them, is :mod:`asyncrl.data.sources`; reasoning-gym's
procedural tasks as records, :mod:`asyncrl.data.procedural`.

Images: a record may carry ``images``: a list, each a file path relative to the dataset file's directory, or a
``data:image/...;base64,...`` URI. Its prompt names each where it goes with the model's image token
(``<image>`` for Idefics3/SmolVLM), once per image, in order; the processor expands each into the image's
tokens (:mod:`asyncrl.models.vision`).

An image travels as an :class:`ImageRef`: a file by its resolved path and the SHA-256 of its bytes (the
trajectory stays small; whoever loads it checks the hash, so an image changed on disk since it was sampled
is an error, never a silent other image), a base64 image by its bytes. Learners therefore read the
dataset's image files from the same path as the generators, as they read the model's directory.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import functools
import hashlib
import importlib
import inspect
import io
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from asyncrl.errors import UserError

RewardFn = Callable[[str, str, dict], float]  # (prompt, completion text, record) -> reward


def load_jsonl(path: str | Path) -> list[dict]:
    """Records with a ``prompt`` string or a chat ``messages`` list (see :func:`prompt_of`), and optionally
    ``images`` (see the module doc); errors name the file and line."""
    records = [rec for _, rec in numbered_jsonl(path)]
    if not records:
        raise UserError(f"dataset file is empty: {path}")
    return records


def write_jsonl(path: str | Path, records: list[dict]) -> None:
    """``records`` as a JSONL dataset file, one compact object per line (what the demos' data scripts write)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))


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
        wrong = (problem or record_problem)(rec)
        if wrong:
            raise UserError(f"{path}:{lineno}: {wrong}")
        records.append((lineno, rec))
    return records


def prompt_of(record: dict) -> str | list[dict]:
    """A record's prompt: its ``prompt`` string, or its ``messages``, a chat of ``{"role", "content"}``
    objects that the tokenizer's chat template renders (ending with a generation prompt); a content is a string
    or a list of text and image parts (a vision-language model's template)."""
    return record["prompt"] if "prompt" in record else record["messages"]


def record_problem(rec: object) -> str | None:
    """What is wrong with one dataset line, or None."""
    if not isinstance(rec, dict) or ("prompt" in rec) == ("messages" in rec):
        return "each line must be an object with a string 'prompt' or a list of chat 'messages'"
    if "images" in rec and (wrong := images_problem(rec["images"])):
        return wrong
    if "prompt" in rec:
        return None if isinstance(rec["prompt"], str) else "'prompt' must be a string"
    messages = rec["messages"]
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {'role': ..., 'content': ...} objects"
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and _is_content(m.get("content"))):
            return (
                f"messages[{i}] must be an object with a string 'role' and a 'content' that is a string or a list "
                "of {'type': 'text', 'text': ...} and {'type': 'image'} parts"
            )
    if messages[-1]["role"] == "assistant":
        return "the last message is the assistant's: the model has nothing to answer"
    return None


def _is_content(content: object) -> bool:
    """A message's content: a string, or parts as vision-language chat templates take them (each image part is
    where the record's next image goes; the template renders it as the model's image token)."""
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(part, dict)
        and (part.get("type") == "image" or (part.get("type") == "text" and isinstance(part.get("text"), str)))
        for part in content
    )


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


def prompt_for_sequence(seq: int, num_prompts: int, seed: int, stream: int = 0) -> tuple[int, int]:
    """Group sequence number -> (epoch, prompt index).

    The buffer hands out sequence numbers 0, 1, 2, ... exactly once across all generators; each
    epoch is a fresh seeded permutation, so every prompt is claimed once per epoch. ``stream``: a
    mixture's source (its own permutations; source 0's are those of a single dataset).
    """
    epoch, pos = divmod(seq, num_prompts)
    return epoch, int(_epoch_order(num_prompts, seed, epoch, stream)[pos])


@functools.lru_cache(maxsize=8)
def _epoch_order(num_prompts: int, seed: int, epoch: int, stream: int) -> np.ndarray:
    order = np.arange(num_prompts, dtype=np.int32)  # 20 MB for 5 million prompts, never int64's 40 MB
    np.random.default_rng([seed, epoch] if stream == 0 else [seed, epoch, stream]).shuffle(order)
    return order  # the same permutation as Generator.permutation(num_prompts), which shuffles an int64 arange


# ----------------------------------------------------------------------------- a record's images

DATA_URI = "data:image/"


@dataclasses.dataclass(frozen=True)
class ImageRef:
    sha256: str  # hex digest of the image file's bytes
    path: str | None = None  # an absolute file path; None: the bytes are inline
    data: bytes | None = None  # the encoded image (PNG, JPEG, ...) for a base64 image; None for a file

    def read(self) -> bytes:
        """The image's encoded bytes, checked against ``sha256``; ``ValueError`` naming what differs."""
        if self.data is not None:
            blob = self.data
        else:
            try:
                blob = Path(self.path).read_bytes()
            except OSError as exc:
                raise ValueError(f"image {self.path} cannot be read: {exc.strerror}") from None
        if hashlib.sha256(blob).hexdigest() != self.sha256:
            raise ValueError(f"image {self.path or '(inline)'} changed since it was sampled (sha256 differs)")
        return blob

    def to_wire(self) -> dict:
        return {"sha256": self.sha256, **({"data": self.data} if self.data is not None else {"path": self.path})}

    @classmethod
    def from_wire(cls, obj: dict) -> ImageRef:
        """``ValueError`` for anything but ``{"sha256", "path"}`` or ``{"sha256", "data"}`` of the right types."""
        if not isinstance(obj, dict) or not isinstance(obj.get("sha256"), str) or len(obj["sha256"]) != 64:
            raise ValueError("an image reference needs a 64-digit 'sha256'")
        if isinstance(obj.get("data"), bytes) and "path" not in obj:
            return cls(obj["sha256"], data=obj["data"])
        if isinstance(obj.get("path"), str) and "data" not in obj:
            return cls(obj["sha256"], path=obj["path"])
        raise ValueError("an image reference needs exactly one of a string 'path' or bytes 'data'")


def images_problem(images: object) -> str | None:
    """What is wrong with a record's ``images`` field (its form only; files are checked by :func:`refs_of`)."""
    if not isinstance(images, list) or not images:
        return "'images' must be a non-empty list of file paths (relative to the dataset) or base64 data URIs"
    for i, item in enumerate(images):
        if not isinstance(item, str) or not item:
            return f"images[{i}] must be a non-empty string: a file path or a data:image/...;base64 URI"
        if item.startswith(DATA_URI) and ";base64," not in item:
            return f"images[{i}] is a data URI without ';base64,'"
    return None


def refs_of(record: dict, base_dir: str | Path) -> list[ImageRef]:
    """The record's images as references (none: ``[]``); a file path is resolved against ``base_dir``.
    ``UserError`` for a missing file or bad base64, naming it."""
    refs = []
    for i, item in enumerate(record.get("images") or []):
        if item.startswith(DATA_URI):
            try:
                blob = base64.b64decode(item.partition(";base64,")[2], validate=True)
            except binascii.Error:
                raise UserError(f"images[{i}]: not valid base64") from None
            refs.append(ImageRef(hashlib.sha256(blob).hexdigest(), data=blob))
        else:
            path = (Path(base_dir) / item).resolve()
            refs.append(ImageRef(_file_sha256(str(path), _mtime(path, i)), path=str(path)))
    return refs


def _mtime(path: Path, index: int) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        raise UserError(f"images[{index}]: image file not found: {path}") from None


@functools.lru_cache(maxsize=4096)
def _file_sha256(path: str, mtime_ns: int) -> str:  # mtime in the key: a rewritten file is hashed again
    del mtime_ns
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def has_images(records: list[dict]) -> bool:
    return any(r.get("images") for r in records)


def missing_images(records: list[dict], base_dir: str | Path) -> list[str]:
    """The image files that ``records`` name and that do not exist (resolved paths, in order, once each)."""
    missing: dict[str, None] = {}
    for rec in records:
        for item in rec.get("images") or []:
            if not item.startswith(DATA_URI) and not (path := Path(base_dir) / item).is_file():
                missing[str(path.resolve())] = None
    return list(missing)


def decode_image(blob: bytes):
    """Encoded image bytes -> an RGB ``PIL.Image``; ``ValueError`` if they are not an image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(blob)) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"not a readable image: {exc}") from None


def load_images(refs: list[ImageRef]) -> list:
    """The images of ``refs`` as RGB ``PIL.Image`` objects, each checked against its hash."""
    return [decode_image(ref.read()) for ref in refs]
