"""What a generator evaluates, and what it shows of the text it samples (pure functions; the loop that
calls them is ``worker``).

Eval points are versions 0, every ``run.eval_every`` and ``run.steps``. A generator evaluates the first
version it serves at or after each point (:func:`points_reached`): versions may pass faster than it
applies them (it goes from 9 to 11), and point 10 is then evaluated at version 11, said in its log and in
the record (``eval/point`` beside ``eval/version``). Each point is claimed once across the fleet
(``eval:<point>``); points passed together are one evaluation, of the version served (``eval/points``
lists them). The last point is always served exactly: the learners stop there.

Eval sets (``data.eval_sets``): each is played greedily, and ``k`` times a prompt at its temperature when asked,
all of them together. A set named ``gsm`` reports ``eval/gsm/reward_mean``, ``eval/gsm/exact_rate`` and, with
``k``, ``eval/gsm/mean@k`` (the mean reward of the k samples) and ``eval/gsm/pass@k`` (the share of prompts of which
a sample is exactly right, reward >= 1); the first set (``data.eval_bar``) is the run's bar, ``eval/reward_mean``.
One unnamed set (``data.eval`` as one source) reports ``eval/...`` alone, as ever.

Samples: the first few episodes of every evaluation, and of the first group a generator finishes at or
after every ``SAMPLE_EVERY`` versions (claimed once across the fleet, ``samples:<point>``), go to the
launcher as a metrics record with ``samples/items``: prompt and completion decoded from their token ids
(special tokens kept: stop tokens show), reward, finish reason. The launcher writes them to
``runs/<name>/samples.jsonl`` (``asyncrl.run.samples``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from statistics import fmean

from asyncrl.generators.outcomes import episode_seed

log = logging.getLogger("asyncrl.generator")

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


@dataclasses.dataclass
class HeldOut:
    """One eval set as a generator plays it: its episodes as (record, prompt, seed, sampling), the greedy one of
    each prompt first, then its ``k`` sampled ones."""

    name: str
    k: int
    reward: Callable | None  # none: the generator's first train reward
    episodes: list[tuple]

    @property
    def prompts(self) -> int:
        return len(self.episodes) // (1 + self.k)


def held_out(spec, records: Sequence[dict], encode: Callable, fits: Callable, greedy, reward, first: int, seed: int):
    """Eval set ``spec`` (an ``EvalSetConfig``) of ``records``, those whose prompt (``encode``) ``fits``, each
    prompt encoded once; its episodes' seeds are numbered from ``first`` (the episodes of the sets before it)."""
    fitting = [(r, p) for r in records if fits(p := encode(r))]
    if skipped := len(records) - len(fitting):
        log.warning("eval set %s: %d prompts do not fit the model's context: left out", spec.name or "-", skipped)
    sampled = dataclasses.replace(greedy, temperature=spec.temperature, top_p=1.0)
    plays = [(r, p, greedy) for r, p in fitting] + [(r, p, sampled) for r, p in fitting for _ in range(spec.k)]
    episodes = [(r, p, episode_seed(seed, -1, first + i), how) for i, (r, p, how) in enumerate(plays)]
    return HeldOut(spec.name, spec.k, reward, episodes)


def by_set(sets: Sequence[HeldOut], played: Sequence) -> list[tuple[HeldOut, Sequence]]:
    """Each set with its slice of ``played``, every set's episodes in order."""
    out, at = [], 0
    for held in sets:
        out.append((held, played[at : at + len(held.episodes)]))
        at += len(held.episodes)
    return out


def set_metrics(held: HeldOut, played: Sequence) -> dict:
    """One set's figures from its ``played`` (context, outcome) pairs, in ``held.episodes``' order."""
    prefix, n, k = f"eval/{held.name}/" if held.name else "eval/", held.prompts, held.k
    greedy = [eval_score(o) for _, o in played[:n]]
    out = {prefix + "failed": sum(o.cause is not None for _, o in played)}
    if n:
        out[prefix + "turns_mean"] = fmean(ctx.turns for ctx, _ in played[:n])
    if valid := [r for r in greedy if r is not None]:
        out[prefix + "reward_mean"] = fmean(valid)
        out[prefix + "exact_rate"] = fmean(r >= 1.0 for r in valid)
    tries = [[s for _, o in played[n + i * k : n + (i + 1) * k] if (s := eval_score(o)) is not None] for i in range(n)]
    if k and (tries := [t for t in tries if t]):  # a prompt whose every sample failed says nothing: left out
        out[prefix + f"mean@{k}"] = fmean(fmean(t) for t in tries)
        out[prefix + f"pass@{k}"] = fmean(any(r >= 1.0 for r in t) for t in tries)
    return out


def eval_record(version: int, points: list[int], sets: Sequence[HeldOut], played: Sequence, seconds: float) -> dict:
    """The metrics record of an evaluation of ``version`` for eval ``points`` (in order); ``played`` is the
    (context, outcome) pairs of every set's episodes, in order. Named sets: the first's greedy figures are the
    run's bar too (``eval/reward_mean``, ``eval/exact_rate``, ``eval/bar`` its name)."""
    record = {
        "eval/version": version,
        "eval/point": points[-1],
        **({"eval/points": points} if len(points) > 1 else {}),
        "eval/seconds": seconds,
    }
    for held, mine in by_set(sets, played):
        record |= set_metrics(held, mine)
    if sets and (bar := sets[0].name):
        record["eval/bar"] = bar
        record["eval/failed"] = sum(record[f"eval/{s.name}/failed"] for s in sets)
        record |= {f"eval/{m}": record[f"eval/{bar}/{m}"] for m in ("reward_mean", "exact_rate", "turns_mean")
                   if f"eval/{bar}/{m}" in record}  # fmt: skip
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


def eval_samples(tokenizer, sets: Sequence[HeldOut], played: Sequence) -> list[dict]:
    """The first ``SAMPLE_ITEMS`` greedy episodes of each eval set (``played``: every set's, in order), a named
    set's with its name."""
    items = []
    for held, mine in by_set(sets, played):
        prompts = [p.ids for _, p, _, _ in held.episodes[: held.prompts]]
        named = {"set": held.name} if held.name else {}
        items += [i | named for i in sample_items(tokenizer, prompts, mine[: held.prompts], SAMPLE_ITEMS)]
    return items


def samples_record(kind: str, version: int, point: int, items: list[dict]) -> dict:
    """A metrics record the launcher writes to ``samples.jsonl``, not ``metrics.jsonl``: ``kind`` is
    ``eval`` or ``train``."""
    return {"samples/kind": kind, "samples/version": version, "samples/point": point, "samples/items": items}
