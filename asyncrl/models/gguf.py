"""GGUF files as HF model directories: ``model.path`` may name a ``.gguf``, which the launcher's preflight
converts once into a cached directory that the whole run (learner, generators, export) then uses.

A GGUF holds llama.cpp's tensors, usually quantised: transformers dequantises them on load (float32
here). transformers 5 refuses ``save_pretrained`` of a GGUF-loaded model, so the loaded weights are
copied into a fresh ``from_config`` model (every key must match: nothing missing, nothing left over)
and that one is saved. The tokenizer comes from the same file; a GGUF whose pre-tokenizer is
``smollm`` (``tokenizer.ggml.pre``: llama.cpp splits digits one by one before the GPT-2 pattern) gets
that split, which transformers' GGUF reader leaves out.

Invariants:
- A directory is complete whenever it exists (it holds ``MARKER``, written last): each builder
  writes a temp directory beside it and renames it into place; concurrent builders are safe (the
  first rename wins, the others use it).
- The cache is keyed by the file's content (xxh3-128), not its path or time: the same GGUF converts
  once, and a changed file converts again. Conversion is deterministic: the same file and library
  versions give the same bytes.

Heavy imports (torch, transformers, gguf) stay inside functions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from asyncrl.errors import UserError

MARKER = "asyncrl_gguf.json"
CACHE_ROOT = Path(".cache/models")
# What converting needs beyond the base install (pyproject's `gguf` extra holds the same)
INSTALL = '.venv/bin/pip install -e ".[gguf]"'
_HASH_CHUNK = 1 << 24  # 16 MiB reads: large enough that hashing runs at disk speed


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def content_hash(path: Path) -> str:
    """xxh3-128 of the file's bytes (hex): ~10 GB/s a core, so keying the cache costs a read."""
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def cache_dir(gguf_file: str | Path, digest: str, root: str | Path = CACHE_ROOT) -> Path:
    """Where ``gguf_file`` (of content hash ``digest``) converts to: ``<root>/gguf-<name>-<16 hex digits>``."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(gguf_file).stem)[:64]
    return Path(root) / f"gguf-{stem}-{digest[:16]}"


def ensure_converted(gguf_file: str | Path, root: str | Path = CACHE_ROOT, log: Callable = print) -> Path:
    """The HF directory of ``gguf_file``, converted on first use; one :class:`UserError` when the file
    is missing or cannot be converted."""
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise UserError(f"model.path {gguf_file} does not exist")
    digest = content_hash(gguf_file)
    directory = cache_dir(gguf_file, digest, root)
    if (directory / MARKER).is_file():
        return directory
    log(f"converting {gguf_file} to an HF model directory at {directory} (once; cached)")

    def build(tmp: Path) -> None:
        convert(gguf_file, tmp)
        write_json(tmp / MARKER, {"source": gguf_file.name, "xxh3_128": digest})

    return publish(directory, build, MARKER)


def write_json(path: Path, record: dict) -> None:
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def publish(path: Path, build: Callable[[Path], None], marker: str) -> Path:
    """Build a directory with ``build(tmp)`` in a temp directory beside ``path`` and rename it into
    place; ``build`` writes ``marker`` last (its presence means complete). The first of concurrent
    builders wins; the others use its directory."""
    if (path / marker).is_file():
        return path
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(f"{path} exists, is not empty and holds no {marker}; not overwriting it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        build(tmp)
        try:
            if path.is_dir():
                path.rmdir()  # empty (checked above); rename cannot replace a directory
            tmp.rename(path)
        except OSError:
            if not (path / marker).is_file():  # not a concurrent builder's win: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def check_installed() -> None:
    """transformers reads GGUF with the ``gguf`` package and loads it through ``accelerate``."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"converting a GGUF model needs {' and '.join(missing)}: {INSTALL}")


def convert(gguf_file: Path, directory: Path) -> None:
    """Write the HF model directory of ``gguf_file`` into ``directory``: ``config.json``, float32
    safetensors, the tokenizer and its chat template. One :class:`UserError` if it cannot be read."""
    check_installed()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # transformers' GGUF reader raises many kinds; each is the same user error
        raise UserError(f"model.path {gguf_file} cannot be converted to an HF model: {_first_line(exc)}") from None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise UserError(
            f"model.path {gguf_file}: its tensors do not match {type(model).__name__} "
            f"(missing {result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]})"
        )
    model.save_pretrained(str(directory))
    save_tokenizer(gguf_file, directory)


def save_tokenizer(gguf_file: Path, directory: Path) -> None:
    """The GGUF's tokenizer with its own pre-tokenizer and chat template, loadable by transformers 4 and 5."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except Exception as exc:
        raise UserError(f"model.path {gguf_file}: its tokenizer cannot be read: {_first_line(exc)}") from None
    if gguf_metadata(gguf_file, "tokenizer.ggml.pre") == "smollm":
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    tok.save_pretrained(str(directory))
    # transformers 5 writes its class as "TokenizersBackend", which 4.x cannot load; both load the
    # same tokenizer.json as "PreTrainedTokenizerFast" (the project allows transformers >= 4.56)
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    write_json(cfg_path, cfg)


def gguf_metadata(gguf_file: Path, key: str):
    """One metadata value of a GGUF (None if absent); reads only the header (memory-mapped)."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_file)).fields.get(key)
    return None if field is None else field.contents()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
