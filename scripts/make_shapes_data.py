"""Write data/shapes/{train,eval}.jsonl deterministically (held-out shapes disjoint from the training ones)
and draw their images (data/shapes/images/, not committed: ``asyncrl.demo.shapes.ensure_images``).

Usage: python scripts/make_shapes_data.py [--out data/shapes]. The records come from
``asyncrl.demo.shapes.make_splits(N_TRAIN, N_EVAL, DATA_SEED)``, the same call the demo-shapes model's
SFT warm-up makes, so the files and the warm-up always agree.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from asyncrl.data import write_jsonl
from asyncrl.demo.shapes import DATA_SEED, N_EVAL, N_TRAIN, ensure_images, make_splits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/shapes", help="output folder")
    args = ap.parse_args()
    train, held_out = make_splits(N_TRAIN, N_EVAL, DATA_SEED)
    out = Path(args.out)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "eval.jsonl", held_out)
    drawn = ensure_images(out / "train.jsonl") + ensure_images(out / "eval.jsonl")
    print(f"wrote {len(train)} train and {len(held_out)} eval records to {out}, drew {drawn} missing images")


if __name__ == "__main__":
    main()
