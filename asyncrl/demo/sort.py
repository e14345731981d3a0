"""The demo task: sort a short string of lowercase letters.

A record is ``{"prompt": "sort:dbca=", "answer": "abcd"}``. Prompts are plain strings, no chat
template; the byte-level demo tokenizer maps each character to one token.

``reward`` gives partial credit (letters used and positions right) because an exact-match reward
is too sparse for a freshly warmed-up policy to climb.
Invariants, pinned by ``tests/demo/test_demo_task.py``: the reward lies in [0, 1], equals 1.0 exactly
when the completion equals the answer, is 0.0 for an empty completion, and never rises by
appending characters to a correct answer.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

PREFIX = "sort:"
SUFFIX = "="
# Tuning: 'a'-'p' with 4-6 distinct letters keeps 4000 training prompts a small fraction of the
# ~6.3M possible ones (so eval tests generalisation) while a 2-layer model can still learn it.
ALPHABET = "abcdefghijklmnop"
MIN_LEN = 4
MAX_LEN = 6
# Share of the reward for using exactly the prompt's letters in any order; the rest is for putting
# each in its place. Small, so that sorting, not echoing, is what pays.
LETTER_WEIGHT = 0.2
# The shipped data files: make_splits(N_TRAIN, N_EVAL, DATA_SEED) reproduces them exactly.
N_TRAIN = 4000
N_EVAL = 256
DATA_SEED = 1234


def make_prompt(letters: str) -> str:
    return f"{PREFIX}{letters}{SUFFIX}"


def make_record(rng: random.Random) -> dict:
    """One record with MIN_LEN..MAX_LEN distinct letters in random order."""
    n = rng.randint(MIN_LEN, MAX_LEN)
    letters = "".join(rng.sample(ALPHABET, n))
    return {"prompt": make_prompt(letters), "answer": "".join(sorted(letters))}


def make_splits(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Train and held-out records with all prompts distinct. Eval is drawn first, so changing
    ``n_train`` never changes the eval set. ``scripts/make_sort_data.py`` writes these to disk."""
    return distinct_splits(make_record, n_train, n_eval, seed)


def distinct_splits(
    make: Callable[[random.Random], dict],
    n_train: int,
    n_eval: int,
    seed: int,
    key: Callable[[dict], str] = lambda record: record["prompt"],
):
    """(train, eval) records drawn by ``make`` from one seeded stream, every ``key`` (the prompt) distinct,
    eval first."""
    rng = random.Random(seed)
    seen: set[str] = set()
    records: list[dict] = []
    while len(records) < n_eval + n_train:
        rec = make(rng)
        if key(rec) not in seen:
            seen.add(key(rec))
            records.append(rec)
    return records[n_eval:], records[:n_eval]


def reward(prompt: str, completion: str, record: dict) -> float:
    """LETTER_WEIGHT x letters right (as a multiset) + the rest x positions right.

    Both parts divide by the longer of completion and answer, so wrong lengths cost credit.
    """
    del prompt  # the record holds the answer
    answer = record["answer"]
    if not completion:
        return 0.0
    longer = max(len(completion), len(answer))
    letters = sum((Counter(completion) & Counter(answer)).values()) / longer
    positions = sum(a == b for a, b in zip(completion, answer, strict=False)) / longer
    return LETTER_WEIGHT * letters + (1.0 - LETTER_WEIGHT) * positions


def exact(completion: str, record: dict) -> bool:
    return completion == record["answer"]


# ----------------------------------------------------------------------------- offline training data


def sft_record(record: dict) -> dict:
    """An ``asyncrl sft`` example: the prompt and its sorted answer (kept as ``answer`` for ``reward``)."""
    return {"prompt": record["prompt"], "response": record["answer"], "answer": record["answer"]}


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A wrong answer, never the answer itself: a near miss (the demo warm-up's bug, the smallest letter
    dropped; two neighbours swapped; descending; another order) or a degenerate one that a policy
    optimising a reward model finds when no pair showed it (one letter repeated to the length limit,
    the answer run on past its end, a letter the prompt does not have)."""
    kind = rng.randrange(7)
    if kind == 0:
        return answer[1:]
    if kind == 1:
        i = rng.randrange(len(answer) - 1)
        return answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
    if kind == 2:
        return answer[::-1]
    if kind == 4:
        return rng.choice(answer) * rng.randint(2, 12)
    if kind == 5:
        return answer + "".join(rng.choice(answer) for _ in range(rng.randint(1, 6)))
    if kind == 6:
        i, outside = rng.randrange(len(answer)), [c for c in ALPHABET if c not in answer]
        return answer[:i] + rng.choice(outside) + answer[i + 1 :]
    letters = list(answer)
    while "".join(letters) == answer:
        rng.shuffle(letters)
    return "".join(letters)


def pair_record(record: dict, rng: random.Random) -> dict:
    """An ``asyncrl rm`` / ``asyncrl dpo`` example: the sorted answer chosen over a near miss."""
    answer = record["answer"]
    return {"prompt": record["prompt"], "chosen": answer, "rejected": wrong_answer(answer, rng), "answer": answer}
