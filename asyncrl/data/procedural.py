"""Tasks from a maintained library: reasoning-gym's procedural reasoning tasks (``pip install reasoning-gym``, the
``reasoning-gym`` extra; nothing to download) as a prompt source, and their own scoring as the reward.

A source ``path: reasoning_gym:<task>`` (``chain_sum``, ``basic_arithmetic``, ... any name reasoning-gym registers)
draws ``size`` records with ``seed``, the task's own options in ``options``; a record is reasoning-gym's entry,
``{"question", "answer", "metadata"}``, and its prompt is the question unless the source maps or templates one.
Records are made when they are read (reasoning-gym seeds each from its index), so a source of any size costs no
memory. Give the held-out set another seed than the training set's. :func:`score` is the matching reward
(``data.reward: asyncrl.data.procedural:score``): the task's ``score_answer`` of the answer the completion's first
line states.
"""

from __future__ import annotations

import functools
import json

from asyncrl.errors import UserError

PREFIX = "reasoning_gym:"


def is_procedural(path: str) -> bool:
    return path.startswith(PREFIX)


class ProceduralRows:
    """A reasoning-gym task's records, read by index as a ``datasets.Dataset``'s rows are."""

    column_names = ("question", "answer", "metadata")

    def __init__(self, path: str, size: int, seed: int, options: dict):
        task = path.removeprefix(PREFIX)
        rg = _library(path)
        try:
            self.tasks = rg.create_dataset(task, size=size, seed=seed, **options)
        except (ValueError, KeyError, TypeError, AssertionError) as exc:
            raise UserError(f"{path}: reasoning-gym cannot make it: {type(exc).__name__}: {exc}") from None

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, index: int) -> dict:
        entry = self.tasks[index]
        # the metadata as JSON keeps it (tuples become lists), as a record crosses to reward workers
        return {"question": entry["question"], "answer": entry["answer"], "metadata": _plain(entry["metadata"])}


def score(prompt: str, completion: str, record: dict) -> float:
    """The task's own ``score_answer`` of the answer the completion states: its first line, after the line's last
    ``=`` if it has one (``4 - 1 - 7 = -4`` states ``-4``; reasoning-gym's answers are one line)."""
    del prompt
    answer = completion.strip().split("\n", 1)[0].rpartition("=")[2].strip()
    return float(_score_fn(record["metadata"]["source_dataset"])(answer=answer, entry=record))


@functools.cache
def _score_fn(task: str):
    return _library(PREFIX + task).get_score_answer_fn(task)


def _library(path: str):
    try:
        import reasoning_gym
    except ImportError:
        raise UserError(f"{path}: reasoning-gym is not installed (pip install 'asyncrl[reasoning-gym]')") from None
    return reasoning_gym


def _plain(value):
    return json.loads(json.dumps(value, default=str))
