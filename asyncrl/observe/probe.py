"""The weight-sync probe: does a generator's engine compute what the learner computes, at every version?

After each step, the learner scores one fixed token sequence (the probe) with the weights it is about
to publish and writes those log-probs to the run's metadata (``probe:<version>``, before the version
is published, so it is always there when a generator looks). After each apply, a generator scores
the same sequence with its engine (vLLM's prompt log-probs, or a transformers forward) and logs the
largest difference per token as ``weights/probe_logprob_diff``; it also keeps the largest difference
any generator found at that version in the metadata (``probe_diff:<version>``, atomically: generators
apply a version at once).

This is the run's sync-health figure. It is cheap (one prefill of at most ``PROBE_TOKENS`` tokens per
version), always on, and independent of the lag: every version every generator applies is compared.
The learner's step record carries it as ``weights/probe_logprob_diff_max`` (:func:`read_health`: the
largest over the kept versions), and ``asyncrl status`` shows it. The behaviour log-prob mismatch
(``learner/behaviour_logprob_mismatch``) is no substitute: the learner holds only its own version's
weights, so it can compare only the tokens that version sampled, and at a lag of 1 or more there are
few or none (it is then null, with ``learner/behaviour_logprob_mismatch_tokens`` 0).

Both sides score at temperature 1 (raw log-probs, what vLLM's prompt log-probs are). The first version's
probe is the first training prompt as the generators encode it, at most ``PROBE_TOKENS`` tokens; each later
version's is a real sampled sequence, the first of the step's batch that made it (prompt and tokens, at most
``SAMPLED_TOKENS``), stored with its ids: the engine-vs-learner mismatch on the sequences a run samples, at
every version and any lag (``weights/probe_logprob_diff_mean``, by quarter of the sequence ``..._q1``-``_q4``,
and ``weights/probe_kl``: the sequence's summed per-token estimate ``exp(d) - 1 - d``, d = learner - engine).

**Sync or numerics.** A bfloat16 engine and learner disagree by far more than float32's 1e-5 with the same
weights, so a difference alone cannot say whether a sync broke. The learner also stores the sequence's
log-probs under the version before (``previous``, the weights it held before the step), and a generator
places its engine between the two (:func:`placement`): ``weights/probe_version_fraction`` t, the
least-squares fit of engine = previous + t (new - previous) over the tokens (1: it holds the new version; 0:
still the old one; between: a mix, e.g. some tensors not applied), and ``weights/probe_sync_missed``, the part
of the step it misses, (1 - t) |new - previous|, over what the fit leaves unexplained (the dtype's numerics
gap). Both are reported only where the step moved the log-probs by more than ``RESOLVABLE`` times that gap:
otherwise the versions cannot be told apart at this dtype and nothing is claimed. ``missed`` above ``MISSED``
is a broken or stale sync, said in one warning line and kept for :func:`health` (``broken``).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence

from asyncrl.chat import ChatTokens
from asyncrl.data import prompt_of

log = logging.getLogger("asyncrl.observe.probe")

PROBE_TOKENS = 64
SAMPLED_TOKENS = 256  # a sampled sequence's probe: one prefill per version per generator, a few ms here
RESOLVABLE = 3.0  # the step's move over the fit's residual above which the engine's version can be told
MISSED = 2.0  # the part of the step an engine misses, over the numerics gap, past which its sync is broken
KEEP_VERSIONS = 8  # probes kept in Redis: a generator that applies a version this late gets none
FIELD_PREFIX = "probe:"  # the run's metadata field of version v is probe:<v>
DIFF_PREFIX = "probe_diff:"  # ... and the largest difference a generator found at v, probe_diff:<v>
ROUTING_PREFIX = "probe_routing:"  # a mixture of experts: the learner's expert choices of the probe at v
ROUTING_DIFF_PREFIX = "probe_routing_diff:"  # ... and the largest routing difference a generator found at v
BROKEN_PREFIX = "probe_broken:"  # 1 - the smallest version fraction a generator found broken at v
# Keep the larger of the stored and the new difference; a non-finite one (stored as "nan") stays: it is
# the worst there is.
_KEEP_MAX = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local new = tonumber(ARGV[2])
if cur and not tonumber(cur) then return 0 end
if (not cur) or (not new) or tonumber(cur) < new then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 1
"""


def probe_ids(chat: ChatTokens, first_record: dict, vision=None) -> list[int]:
    """The probe sequence: the run's first training record as ``chat`` (the run's encoding) encodes its
    prompt, cut to ``PROBE_TOKENS`` (the same in the learner and every generator). A vision-language model
    (``vision``: its ``VisionInputs``) is probed on the prompt's text alone, without its image tokens: the
    probe checks the language model's weights, not the vision tower's."""
    ids = chat.prompt_ids(prompt_of(first_record))
    if vision is not None:
        ids = [t for t in ids if t != vision.image_token_id]
    return ids[:PROBE_TOKENS]


def field(version: int) -> str:
    return f"{FIELD_PREFIX}{version}"


def diff_field(version: int) -> str:
    return f"{DIFF_PREFIX}{version}"


def routing_field(version: int) -> str:
    return f"{ROUTING_PREFIX}{version}"


def routing_diff_field(version: int) -> str:
    return f"{ROUTING_DIFF_PREFIX}{version}"


def broken_field(version: int) -> str:
    return f"{BROKEN_PREFIX}{version}"


def is_probe_field(name: str) -> bool:
    """Whether a metadata field is the probe's (its log-probs, routing or a difference), not the run's own."""
    prefixes = (DIFF_PREFIX, ROUTING_DIFF_PREFIX, ROUTING_PREFIX, BROKEN_PREFIX)
    prefix = next((p for p in prefixes if name.startswith(p)), FIELD_PREFIX)
    return name.startswith(prefix) and name[len(prefix) :].lstrip("-").isdigit()


def sampled_ids(groups: Sequence) -> list[int] | None:
    """The next version's probe: the first ``ok`` sample of ``groups`` (a step's batch), its prompt and tokens
    cut to ``SAMPLED_TOKENS``; None when the batch holds no such sample."""
    for group in groups:
        for sample in group.samples:
            if sample.status == "ok" and len(sample.tokens):
                ids = [int(t) for t in group.prompt_ids] + [int(t) for t in sample.tokens]
                return ids[:SAMPLED_TOKENS]
    return None


def publish(
    control,
    version: int,
    logprobs: Sequence[float],
    routing: list | None = None,
    ids: Sequence[int] | None = None,
    previous: Sequence[float] | None = None,
) -> None:
    """The learner's log-probs of version ``version`` and, for a mixture of experts, its expert choices of
    the probe (per layer, per token, sorted: ``asyncrl.models.routers.choices_of``); ``ids``: a sampled
    sequence's (a generator scores these instead of its fixed probe), ``previous``: its log-probs under the
    version before. Older probes and their differences are dropped."""
    if routing is not None:
        control.set_meta(routing_field(version), json.dumps(routing))
        control.forget_meta(routing_field(version - KEEP_VERSIONS))
        control.forget_meta(routing_diff_field(version - KEEP_VERSIONS))
    stored: list | dict = [float(x) for x in logprobs]
    if ids is not None:
        stored = {"ids": [int(t) for t in ids], "logprobs": stored}
        if previous is not None:
            stored["previous"] = [float(x) for x in previous]
    control.set_meta(field(version), json.dumps(stored))
    for name in (field, diff_field, broken_field):
        control.forget_meta(name(version - KEEP_VERSIONS))


def _stored(control, version: int) -> dict | None:
    """The learner's probe of ``version`` as ``{"logprobs", "ids"?, "previous"?}``, None when gone."""
    raw = control.get_meta(field(version))
    if raw is None:
        return None
    stored = json.loads(raw)
    return {"logprobs": stored} if isinstance(stored, list) else stored


def ids_of(control, version: int) -> list[int] | None:
    """The sampled sequence the learner's probe of ``version`` is of; None: the run's fixed probe (or gone)."""
    stored = _stored(control, version)
    return None if stored is None else stored.get("ids")


def compare(control, version: int, logprobs: Sequence[float], routing: list | None = None) -> dict[str, float]:
    """A generator's record of its probe at ``version`` against the learner's (:func:`figures`) and, for a
    mixture of experts, ``weights/probe_routing_diff``: the fraction of (token, layer) whose top-k experts
    differ between the engine and the learner with the same weights. Empty when the learner's probe of
    ``version`` is gone. The largest difference, and a broken sync's fraction, are kept in the run's metadata
    for :func:`read_health`; a broken sync is also said in one warning line."""
    record = {}
    stored = _stored(control, version)
    diff = difference(control, version, logprobs, stored)
    if diff is not None and "ids" not in stored:  # the fixed probe: its sync figure alone
        record = {"weights/probe_logprob_diff": diff}
    elif diff is not None:  # a sampled sequence: the mismatch's figures, the sync told from the numerics
        record = figures(stored["logprobs"], logprobs, stored.get("previous"), version)
        fraction, missed = record.get("weights/probe_version_fraction"), record.get("weights/probe_sync_missed", 0.0)
        if missed > MISSED:
            control.r.eval(_KEEP_MAX, 1, control.keys.meta, broken_field(version), f"{1 - fraction:.6g}")
            log.warning(
                "weight sync of version %d is broken or stale: the engine's log-probs of the probe sit %.2f of the "
                "way from version %d to %d (1: the version applied): it misses %.3g times what the numerics gap "
                "of its dtype explains",
                version,
                fraction,
                version - 1,
                version,
                missed,
            )
    routes = control.get_meta(routing_field(version)) if routing is not None else None
    if routes is not None:
        record["weights/probe_routing_diff"] = diff = routing_difference(json.loads(routes), routing)
        control.r.eval(_KEEP_MAX, 1, control.keys.meta, routing_diff_field(version), f"{diff:.6g}")
    return record


def figures(
    learner: Sequence[float], engine: Sequence[float], previous: Sequence[float] | None, version: int
) -> dict[str, float]:
    """The engine's log-probs of the probe against the learner's with the same weights: the largest and mean
    |difference| (``weights/probe_logprob_diff``, ``..._mean``), the mean by quarter of the sequence
    (``..._q1``-``_q4``), the summed estimate ``exp(d) - 1 - d`` (``weights/probe_kl``), and where the learner
    gave ``previous`` and the step moved them resolvably, the version fraction (module doc)."""
    if len(learner) != len(engine):
        raise ValueError(f"probe of version {version}: {len(engine)} log-probs, the learner's has {len(learner)}")
    d = [a - b for a, b in zip(learner, engine, strict=True)]
    absd = [abs(x) for x in d]
    record = {
        "weights/probe_logprob_diff": max(absd, default=0.0),
        "weights/probe_logprob_diff_mean": sum(absd) / max(len(d), 1),
        "weights/probe_kl": sum(math.expm1(x) - x for x in d),
    }
    for q in range(4):
        part = absd[q * len(d) // 4 : (q + 1) * len(d) // 4]
        if part:
            record[f"weights/probe_logprob_diff_q{q + 1}"] = sum(part) / len(part)
    placed = placement(previous, learner, engine) if previous is not None else None
    if placed is not None:
        record["weights/probe_version_fraction"], record["weights/probe_sync_missed"] = placed
    return record


def placement(previous: Sequence[float], new: Sequence[float], engine: Sequence[float]) -> tuple[float, float] | None:
    """Where the engine sits between two versions: ``(t, missed)``, t of the least-squares fit engine =
    previous + t (new - previous), and ``missed``: the part of the step it misses, (1 - t) |new - previous|,
    over what the fit leaves unexplained (the numerics gap). None where the step moved less than
    ``RESOLVABLE`` times that residual (or nothing moved, or the lengths differ): the gap then hides which
    version the engine holds."""
    if not (len(previous) == len(new) == len(engine)) or not previous:
        return None
    move = [b - a for a, b in zip(previous, new, strict=True)]
    off = [e - a for a, e in zip(previous, engine, strict=True)]
    moved = sum(m * m for m in move)
    if not math.isfinite(moved) or moved == 0.0 or not all(math.isfinite(x) for x in off):
        return None
    t = sum(m * o for m, o in zip(move, off, strict=True)) / moved
    residual = math.sqrt(sum((o - t * m) ** 2 for m, o in zip(move, off, strict=True)))
    if math.sqrt(moved) <= RESOLVABLE * residual:
        return None
    missed = (1 - t) * math.sqrt(moved)
    return t, missed / residual if residual > 0 else math.copysign(math.inf, missed) if missed else 0.0


def routing_difference(learner: list, engine: list) -> float:
    """The fraction of (layer, token) pairs whose sorted top-k expert ids differ; the shapes must agree."""
    if len(learner) != len(engine) or any(len(a) != len(b) for a, b in zip(learner, engine, strict=True)):
        shapes = [len(layer) for layer in learner], [len(layer) for layer in engine]
        raise ValueError(f"probe routing: the learner's has tokens per layer {shapes[0]}, the engine's {shapes[1]}")
    pairs = [(a, b) for la, le in zip(learner, engine, strict=True) for a, b in zip(la, le, strict=True)]
    return sum(list(a) != list(b) for a, b in pairs) / max(len(pairs), 1)


def difference(control, version: int, logprobs: Sequence[float], stored: dict | None = None) -> float | None:
    """The largest |generator - learner| log-prob over the probe's tokens, or None when the learner's
    probe of ``version`` is not (or no longer) there; kept in the metadata for :func:`read_health`.
    ``stored``: the learner's probe, when the caller has read it already."""
    stored = _stored(control, version) if stored is None else stored
    if stored is None:
        return None
    reference = stored["logprobs"]
    if len(reference) != len(logprobs):
        raise ValueError(f"probe of version {version}: {len(logprobs)} log-probs, the learner's has {len(reference)}")
    diff = max((abs(a - b) for a, b in zip(logprobs, reference, strict=True)), default=0.0)
    value = f"{diff:.6g}" if math.isfinite(diff) else "nan"
    control.r.eval(_KEEP_MAX, 1, control.keys.meta, diff_field(version), value)
    return diff


def health(meta: Mapping[str, str]) -> dict:
    """The sync-health figure from the run's metadata fields: ``probe_logprob_diff_max``, the largest
    difference any generator found over the kept versions (None before any compared; NaN when one found
    a non-finite difference), ``versions``: each compared version's largest difference, and, for a mixture of
    experts, ``probe_routing_diff_max``: the largest routing difference over the kept versions (else None);
    ``broken`` (where any): each kept version a generator found broken or stale, its smallest version fraction."""
    diffs, routing = _by_version(meta, DIFF_PREFIX), _by_version(meta, ROUTING_DIFF_PREFIX)
    broken = _by_version(meta, BROKEN_PREFIX)  # stored as 1 - t, the largest kept: the smallest t
    worst = None
    if diffs:
        worst = math.nan if any(math.isnan(d) for d in diffs.values()) else max(diffs.values())
    return {
        "probe_logprob_diff_max": worst,
        "versions": {str(v): diffs[v] for v in sorted(diffs)},
        "probe_routing_diff_max": max(routing.values()) if routing else None,
        **({"broken": {str(v): 1 - broken[v] for v in sorted(broken)}} if broken else {}),
    }


def _by_version(meta: Mapping[str, str], prefix: str) -> dict[int, float]:
    out = {}
    for name, value in meta.items():
        version = name[len(prefix) :]
        if name.startswith(prefix) and version.lstrip("-").isdigit():
            out[int(version)] = float(value)
    return out


def read_health(control) -> dict:
    """:func:`health` of the run ``control`` names (one read of its metadata)."""
    fields = control.r.hgetall(control.keys.meta)
    prefixes = (DIFF_PREFIX.encode(), ROUTING_DIFF_PREFIX.encode(), BROKEN_PREFIX.encode())
    return health({k.decode(): v.decode(errors="replace") for k, v in fields.items() if k.startswith(prefixes)})
