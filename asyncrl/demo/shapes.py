"""The vision demo task: name the colour of the one shape in a small picture.

A record is ``{"prompt": "<image>What colour is the shape?\\nAnswer: ", "images": ["images/square-red-10-20-14.png"],
"answer": "red", "shape": {"kind": "square", "colour": "red", "x": 10, "y": 20, "size": 14}}``: one filled
shape (``KINDS``, colour from ``COLOURS``) on a black ``IMAGE_SIZE`` square, its bounding box's top-left
corner at (x, y) and ``size`` pixels wide. The prompt holds the literal ``<image>`` once per image, where
the image goes (the Idefics3 processor expands it); a plain string, no chat template.

Invariants, pinned by ``tests/demo/test_demo_shapes.py``:
- ``images`` are paths relative to the dataset file's directory. The PNGs are never committed: each is
  drawn from its record's ``shape`` alone (:func:`draw`), so the same fields give the same bytes, and an
  image's name spells out those fields, so a changed record can never reuse a stale picture.
- :func:`ensure_images` writes only missing images, each through a temp file and an atomic rename:
  concurrent callers (two generators starting at once) both succeed and leave whole files.
- ``reward`` is 1.0 exactly when :func:`exact` holds, else 0.0 (so 0.0 for an empty completion).
"""

from __future__ import annotations

import json
import os
import random
import uuid
from pathlib import Path

from asyncrl.demo.sort import distinct_splits

PROMPT = "<image>What colour is the shape?\nAnswer: "
IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 64  # the demo model's vision tower sees 64x64 (8x8 patches of 8 pixels)
# Pure RGB values: a drawn shape's pixels are exactly its colour (no anti-aliasing), which the tests check.
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0)}
# The warm-up's systematic mistake names the NEXT colour of this cycle; every answer starts with a
# different byte, so the two modes part at the first answer token.
COLOUR_CYCLE = ("red", "green", "blue", "yellow")
KINDS = ("square", "circle", "triangle")
# Sizes from one 8-pixel patch of the vision tower up to almost half the picture: a small shape lies in
# one to four patches, a large one across many.
MIN_SIZE, MAX_SIZE = 8, 28
# The shipped data files: make_splits(N_TRAIN, N_EVAL, DATA_SEED) reproduces them exactly.
N_TRAIN = 2000
N_EVAL = 256
DATA_SEED = 4321
DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "shapes"  # the shipped files, wherever the cwd is
SPLIT_FILES = ("train.jsonl", "eval.jsonl")


def next_colour(colour: str) -> str:
    """The colour after ``colour`` in ``COLOUR_CYCLE`` (the warm-up's wrong answer)."""
    return COLOUR_CYCLE[(COLOUR_CYCLE.index(colour) + 1) % len(COLOUR_CYCLE)]


def image_name(shape: dict) -> str:
    """The image's path relative to the dataset file, spelt from every field that draws it."""
    return f"images/{shape['kind']}-{shape['colour']}-{shape['x']}-{shape['y']}-{shape['size']}.png"


def make_shape(rng: random.Random) -> dict:
    size = rng.randint(MIN_SIZE, MAX_SIZE)
    return {
        "kind": rng.choice(KINDS),
        "colour": rng.choice(sorted(COLOURS)),
        "x": rng.randint(0, IMAGE_SIZE - size),
        "y": rng.randint(0, IMAGE_SIZE - size),
        "size": size,
    }


def make_record(rng: random.Random) -> dict:
    shape = make_shape(rng)
    return {"prompt": PROMPT, "images": [image_name(shape)], "answer": shape["colour"], "shape": shape}


def make_splits(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Train and held-out records with all shapes (so all images) distinct; eval is drawn first.
    ``scripts/make_shapes_data.py`` writes these to disk."""
    return distinct_splits(make_record, n_train, n_eval, seed, key=lambda record: record["images"][0])


def draw(shape: dict):
    """The shape as a ``PIL.Image`` (RGB, ``IMAGE_SIZE`` square, black ground); a pure function of ``shape``."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE))
    pen = ImageDraw.Draw(image)
    x, y, s, fill = shape["x"], shape["y"], shape["size"], COLOURS[shape["colour"]]
    box = (x, y, x + s - 1, y + s - 1)
    if shape["kind"] == "square":
        pen.rectangle(box, fill=fill)
    elif shape["kind"] == "circle":
        pen.ellipse(box, fill=fill)
    elif shape["kind"] == "triangle":
        pen.polygon([(x + (s - 1) / 2, y), (x, y + s - 1), (x + s - 1, y + s - 1)], fill=fill)
    else:
        raise ValueError(f"unknown shape kind {shape['kind']!r}")
    return image


def record_images(record: dict) -> list:
    """The record's images, in its ``images`` order, drawn in memory (what the files on disk hold)."""
    return [draw(record["shape"])]


def ensure_images(dataset_path: str | Path) -> int:
    """Draw every image the dataset file names that is not on disk yet, beside the file (its records name
    their images relative to its folder); return how many were written. Records without a ``shape`` are not
    this task's: their images are left to the dataset (the launch's preflight names any that are missing).

    Safe for concurrent callers: each writes its own temp file in the image's folder and renames it
    into place (atomic on POSIX), so a reader sees no file or a whole one; a lost race rewrites the
    same bytes.
    """
    root = Path(dataset_path).parent
    written = 0
    for line in Path(dataset_path).read_text().splitlines():
        record = json.loads(line)
        if "shape" not in record or all((root / rel).exists() for rel in record["images"]):
            continue
        for rel, image in zip(record["images"], record_images(record), strict=True):
            path = root / rel
            if path.exists():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            try:
                image.save(tmp, format="PNG")
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            written += 1
    return written


def reward(prompt: str, completion: str, record: dict) -> float:
    """1.0 for the right colour (:func:`exact`), else 0.0: a colour has no near misses worth credit."""
    del prompt  # the record holds the answer
    return 1.0 if exact(completion, record) else 0.0


def exact(completion: str, record: dict) -> bool:
    """The completion (EOS already stripped) is the answer word alone, ignoring surrounding whitespace
    and case: "red", " Red\\n" count; "red." and "red square" do not (the policy must also stop)."""
    return completion.strip().lower() == record["answer"]
