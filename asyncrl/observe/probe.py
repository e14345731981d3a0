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

Both sides score at temperature 1 (raw log-probs, what vLLM's prompt log-probs are). The probe is the
first training prompt as the generators encode it, at most ``PROBE_TOKENS`` tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

from asyncrl.chat import ChatTokens
from asyncrl.data import prompt_of

PROBE_TOKENS = 64
KEEP_VERSIONS = 8  # probes kept in Redis: a generator that applies a version this late gets none
FIELD_PREFIX = "probe:"  # the run's metadata field of version v is probe:<v>
DIFF_PREFIX = "probe_diff:"  # ... and the largest difference a generator found at v, probe_diff:<v>
ROUTING_PREFIX = "probe_routing:"  # a mixture of experts: the learner's expert choices of the probe at v
ROUTING_DIFF_PREFIX = "probe_routing_diff:"  # ... and the largest routing difference a generator found at v
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


def is_probe_field(name: str) -> bool:
    """Whether a metadata field is the probe's (its log-probs, routing or a difference), not the run's own."""
    prefixes = (DIFF_PREFIX, ROUTING_DIFF_PREFIX, ROUTING_PREFIX)
    prefix = next((p for p in prefixes if name.startswith(p)), FIELD_PREFIX)
    return name.startswith(prefix) and name[len(prefix) :].lstrip("-").isdigit()


def publish(control, version: int, logprobs: Sequence[float], routing: list | None = None) -> None:
    """The learner's log-probs of version ``version`` and, for a mixture of experts, its expert choices of
    the probe (per layer, per token, sorted: ``asyncrl.models.routers.choices_of``); older probes and their
    differences are dropped."""
    if routing is not None:
        control.set_meta(routing_field(version), json.dumps(routing))
        control.forget_meta(routing_field(version - KEEP_VERSIONS))
        control.forget_meta(routing_diff_field(version - KEEP_VERSIONS))
    control.set_meta(field(version), json.dumps([float(x) for x in logprobs]))
    control.forget_meta(field(version - KEEP_VERSIONS))
    control.forget_meta(diff_field(version - KEEP_VERSIONS))


def compare(control, version: int, logprobs: Sequence[float], routing: list | None = None) -> dict[str, float]:
    """A generator's record of its probe at ``version`` against the learner's: ``weights/probe_logprob_diff``
    (:func:`difference`) and, for a mixture of experts, ``weights/probe_routing_diff``: the fraction of
    (token, layer) whose top-k experts differ between the engine and the learner with the same weights.
    Empty when the learner's probe of ``version`` is gone."""
    record = {}
    diff = difference(control, version, logprobs)
    if diff is not None:
        record["weights/probe_logprob_diff"] = diff
    stored = control.get_meta(routing_field(version)) if routing is not None else None
    if stored is not None:
        record["weights/probe_routing_diff"] = diff = routing_difference(json.loads(stored), routing)
        control.r.eval(_KEEP_MAX, 1, control.keys.meta, routing_diff_field(version), f"{diff:.6g}")
    return record


def routing_difference(learner: list, engine: list) -> float:
    """The fraction of (layer, token) pairs whose sorted top-k expert ids differ; the shapes must agree."""
    if len(learner) != len(engine) or any(len(a) != len(b) for a, b in zip(learner, engine, strict=True)):
        shapes = [len(layer) for layer in learner], [len(layer) for layer in engine]
        raise ValueError(f"probe routing: the learner's has tokens per layer {shapes[0]}, the engine's {shapes[1]}")
    pairs = [(a, b) for la, le in zip(learner, engine, strict=True) for a, b in zip(la, le, strict=True)]
    return sum(list(a) != list(b) for a, b in pairs) / max(len(pairs), 1)


def difference(control, version: int, logprobs: Sequence[float]) -> float | None:
    """The largest |generator - learner| log-prob over the probe's tokens, or None when the learner's
    probe of ``version`` is not (or no longer) there; kept in the metadata for :func:`read_health`."""
    stored = control.get_meta(field(version))
    if stored is None:
        return None
    reference = json.loads(stored)
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
    experts, ``probe_routing_diff_max``: the largest routing difference over the kept versions (else None)."""
    diffs, routing = _by_version(meta, DIFF_PREFIX), _by_version(meta, ROUTING_DIFF_PREFIX)
    worst = None
    if diffs:
        worst = math.nan if any(math.isnan(d) for d in diffs.values()) else max(diffs.values())
    return {
        "probe_logprob_diff_max": worst,
        "versions": {str(v): diffs[v] for v in sorted(diffs)},
        "probe_routing_diff_max": max(routing.values()) if routing else None,
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
    prefixes = (DIFF_PREFIX.encode(), ROUTING_DIFF_PREFIX.encode())
    return health({k.decode(): v.decode(errors="replace") for k, v in fields.items() if k.startswith(prefixes)})
