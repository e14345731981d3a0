"""The demo recipes' entry point: build a recipe's model once, warm it up and publish it in the model cache.

``demo-sort`` builds in ``asyncrl.demo.model``; ``demo-calc`` and ``demo-guess`` (multi-turn) in
``asyncrl.demo.warmup``; ``demo-shapes`` (vision-language: an Idefics3, saved with its processor) in
``asyncrl.demo.vlm``. The launcher's preflight calls :func:`prepare_demo_model` when ``model.recipe`` names one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncrl.demo import model as model_mod
from asyncrl.demo import shapes, vlm, warmup
from asyncrl.demo.model import RECIPE, RECIPE_FILE


def is_prepared(path: str | Path) -> bool:
    return (Path(path) / RECIPE_FILE).is_file()


def prepare_demo_model(
    path: str | Path,
    seed: int = 0,
    log: Callable[[str], Any] = print,
    recipe: str = RECIPE,
    datasets: Sequence[str | Path] = (),
) -> Path:
    """Build, warm up and save the ``recipe``'s demo model at ``path``; return at once if it is already there.

    ``demo-sort`` is built here; ``demo-calc`` and ``demo-guess`` (multi-turn) by ``asyncrl.demo.warmup``;
    ``demo-shapes`` by ``asyncrl.demo.vlm``, which also needs its data's images: drawn here, cached model or
    not, as they are not committed, beside each of ``datasets`` (the run's train and eval files; default the
    shipped ones). Concurrent callers are safe: each builds in its own temp directory and the first rename
    wins (image files likewise, see ``shapes.ensure_images``).
    """
    path = Path(path)
    ensure_data(recipe, datasets, log)
    if is_prepared(path):
        cached = json.loads((path / RECIPE_FILE).read_text()).get("recipe")
        if cached != recipe:
            raise FileExistsError(f"{path} holds the {cached} demo model, not {recipe}")
        log(f"demo model: using cached {path}")
        return path
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} exists, is not empty and holds no {RECIPE_FILE}; not overwriting it")
    processor = None
    if recipe in (RECIPE, model_mod.MOE_RECIPE):
        model, tokenizer, record = model_mod.build_sort(seed, log, recipe)
    elif recipe == vlm.RECIPE:
        model, tokenizer, processor, record = vlm.build_shapes(seed, log)
    else:
        model, tokenizer, record = warmup.build(recipe, seed, log)
    _publish(path, model, tokenizer, record, processor)
    return path


def ensure_data(recipe: str, datasets: Sequence[str | Path] = (), log: Callable[[str], Any] = print) -> None:
    """What a recipe's data needs on disk and git does not hold: ``demo-shapes``' images, drawn beside each of
    ``datasets`` (the run's train and eval files; default the shipped ones) where missing."""
    if recipe != vlm.RECIPE:
        return
    for dataset in datasets or [shapes.DATA_DIR / name for name in shapes.SPLIT_FILES]:
        if drawn := shapes.ensure_images(dataset):
            log(f"demo model: drew {drawn} missing images under {Path(dataset).parent / 'images'}")


def _portable_tokenizer_class(directory: Path) -> None:
    """transformers 5 saves its class as "TokenizersBackend", which 4.x cannot load; both load the
    same tokenizer.json as "PreTrainedTokenizerFast" (the project allows transformers >= 4.56)."""
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def _publish(path: Path, model, tokenizer, recipe: dict, processor=None) -> None:
    """Save into a temp directory and rename it to ``path``; a processor (a vision model's) saves the
    tokenizer with its own config, so ``AutoProcessor.from_pretrained(path)`` works."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)
        (tokenizer if processor is None else processor).save_pretrained(tmp)
        _portable_tokenizer_class(tmp)
        (tmp / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
        try:
            if path.is_dir() and not is_prepared(path):
                path.rmdir()  # empty (the caller checked); rename cannot replace a directory
            tmp.rename(path)
        except OSError:
            if not is_prepared(path):  # lost the race to a concurrent builder: theirs is as good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
