"""What a generator evaluates, and what it shows of the text it samples (pure functions; the loop that
calls them is ``worker``).

Eval points are versions 0, every ``run.eval_every`` and ``run.steps``. A generator evaluates the first
version it serves at or after each point (:func:`points_reached`): versions may pass faster than it
applies them (it goes from 9 to 11), and point 10 is then evaluated at version 11, said in its log and in
the record (``eval/point`` beside ``eval/version``). Each point is claimed once across the fleet
(``eval:<point>``); points passed together are one evaluation, of the version served (``eval/points``
lists them). The last point is always served exactly: the learners stop there.

Samples: the first few episodes of every evaluation, and of the first group a generator finishes at or
after every ``SAMPLE_EVERY`` versions (claimed once across the fleet, ``samples:<point>``), go to the
launcher as a metrics record with ``samples/items``: prompt and completion decoded from their token ids
(special tokens kept: stop tokens show), reward, finish reason. The launcher writes them to
``runs/<name>/samples.jsonl`` (``asyncrl.run.samples``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from statistics import fmean

POLICY_FAILURES = {"budget"}  # failures that are the policy's doing: an evaluation scores them 0
SAMPLE_EVERY = 10  # versions between training samples: the demo's 40 versions show 5, 1000 steps about 100 KB
SAMPLE_ITEMS = 4  # completions per sample record: a group's spread, few enough to read
TEXT_CHARS = 4000  # a longer prompt or completion is cut: a line stays readable and the log small
CUT_MARK = "[... cut]"


def eval_points(steps: int, every: int) -> set[int]:
    """Versions that get a greedy held-out evaluation: the first, every ``eval_every``, the last."""
    due = set(range(0, steps, every)) if every else {0}
    return due | {steps}


def points_reached(pending: Iterable[int], version: int) -> list[int]:
    """The points of ``pending`` that a generator serving ``version`` has reached (at or below it), in
    order: each is evaluated (or sampled) at ``version``, the first version served at or after it."""
    return sorted(p for p in pending if p <= version)


def eval_score(outcome) -> float | None:
    """An evaluation episode's score: its reward; 0 for the policy's own failure; None (left out) for a
    failure that says nothing of the policy."""
    if outcome.cause is None:
        return outcome.reward
    return 0.0 if outcome.cause in POLICY_FAILURES else None


def eval_record(version: int, points: list[int], played: Sequence, seconds: float) -> dict:
    """The metrics record of an evaluation of ``version`` for eval ``points`` (in order); ``played`` is its
    (context, outcome) pairs."""
    scores = [eval_score(o) for _, o in played]
    valid = [r for r in scores if r is not None]
    record = {
        "eval/version": version,
        "eval/point": points[-1],
        **({"eval/points": points} if len(points) > 1 else {}),
        "eval/failed": sum(o.cause is not None for _, o in played),
        "eval/turns_mean": fmean(ctx.turns for ctx, _ in played),
        "eval/seconds": seconds,
    }
    if valid:
        record["eval/reward_mean"] = fmean(valid)
        record["eval/exact_rate"] = fmean(r >= 1.0 for r in valid)
    return record


def cut(text: str, limit: int = TEXT_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + CUT_MARK


def sample_items(tokenizer, prompts: Sequence[Sequence[int]], played: Sequence, limit: int) -> list[dict]:
    """The first ``limit`` episodes of ``played`` ((context, outcome) pairs, ``prompts`` their prompts'
    token ids) as the model saw and wrote them."""
    items = []
    for prompt, (ctx, outcome) in list(zip(prompts, played, strict=True))[:limit]:
        item = {
            "prompt": cut(tokenizer.decode(list(prompt))),
            "completion": cut(tokenizer.decode(list(ctx.tokens))),
            "reward": outcome.reward,
            "finish_reason": ctx.finish_reason,
        }
        if outcome.cause is not None:
            item["failed"] = outcome.cause
        items.append(item)
    return items


def samples_record(kind: str, version: int, point: int, items: list[dict]) -> dict:
    """A metrics record the launcher writes to ``samples.jsonl``, not ``metrics.jsonl``: ``kind`` is
    ``eval`` or ``train``."""
    return {"samples/kind": kind, "samples/version": version, "samples/point": point, "samples/items": items}
