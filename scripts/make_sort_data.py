"""Write data/sort/{train,eval}.jsonl deterministically (held-out prompts disjoint), and the offline
modes' forms of the same records: sft_{train,eval}.jsonl (prompt, response) and pairs_{train,eval}.jsonl
(prompt, chosen, rejected; ``sort.pair_record``).

Usage: python scripts/make_sort_data.py [--out data/sort]. The records come from
``asyncrl.demo.sort.make_splits(N_TRAIN, N_EVAL, DATA_SEED)``, the same call the demo model's SFT
warm-up makes, so the files and the warm-up always agree.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from asyncrl.data import write_jsonl
from asyncrl.demo.sort import DATA_SEED, N_EVAL, N_TRAIN, make_splits, pair_record, sft_record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/sort", help="output folder")
    args = ap.parse_args()
    train, held_out = make_splits(N_TRAIN, N_EVAL, DATA_SEED)
    out = Path(args.out)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "eval.jsonl", held_out)
    for split, records in (("train", train), ("eval", held_out)):
        rng = random.Random(f"{DATA_SEED}-pairs-{split}")
        write_jsonl(out / f"sft_{split}.jsonl", [sft_record(r) for r in records])
        write_jsonl(out / f"pairs_{split}.jsonl", [pair_record(r, rng) for r in records])
    print(f"wrote {len(train)} train and {len(held_out)} eval records to {out}")


if __name__ == "__main__":
    main()
