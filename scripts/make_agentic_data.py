"""Write the agentic and chat demos' data deterministically: data/<task>/{train,eval}.jsonl for calc, guess, arith.

Usage: python scripts/make_agentic_data.py [--out data] [--task arith|calc|guess]. The records come from
``asyncrl.demo.calc.make_splits(N_TRAIN, N_EVAL, DATA_SEED)`` and
``asyncrl.demo.guess.make_splits(N_TRAIN, DATA_SEED)``, the calls the ``demo-calc`` / ``demo-guess``
warm-ups make, so the files and the warm-ups always agree; ``asyncrl.demo.arith.make_splits(N_TRAIN, N_EVAL,
DATA_SEED)`` for the SmolLM2 config (configs/smollm2-arith.yaml).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from asyncrl.data import write_jsonl
from asyncrl.demo import arith, calc, guess

SPLITS = {
    "arith": lambda: arith.make_splits(arith.N_TRAIN, arith.N_EVAL, arith.DATA_SEED),
    "calc": lambda: calc.make_splits(calc.N_TRAIN, calc.N_EVAL, calc.DATA_SEED),
    "guess": lambda: guess.make_splits(guess.N_TRAIN, guess.DATA_SEED),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data", help="parent folder: writes <out>/<task>/{train,eval}.jsonl")
    ap.add_argument("--task", choices=sorted(SPLITS), action="append", help="only this task (repeatable)")
    args = ap.parse_args()
    for task in args.task or sorted(SPLITS):
        train, held_out = SPLITS[task]()
        out = Path(args.out) / task
        write_jsonl(out / "train.jsonl", train)
        write_jsonl(out / "eval.jsonl", held_out)
        print(f"wrote {len(train)} train and {len(held_out)} eval records to {out}")


if __name__ == "__main__":
    main()
