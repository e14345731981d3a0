"""The weight-sync probe: does a generator's engine compute what the learner computes, at every version?

After each step, the learner scores one fixed token sequence (the probe) with the weights it is about
to publish and writes those log-probs to the run's metadata (``probe:<version>``, before the version
is published, so it is always there when a generator looks). After each apply, a generator scores
the same sequence with its engine (vLLM's prompt log-probs, or a transformers forward) and logs the
largest difference per token as ``weights/probe_logprob_diff``. It is cheap (one prefill of at most
``PROBE_TOKENS`` tokens per version), always on, and independent of the lag: unlike the behaviour
log-prob mismatch, which only tokens sampled by the learner's own version can show.

Both sides score at temperature 1 (raw log-probs, what vLLM's prompt log-probs are). The probe is the
first training prompt as the generators encode it, at most ``PROBE_TOKENS`` tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from asyncrl.chat import ChatTokens
from asyncrl.data import prompt_of

PROBE_TOKENS = 64
KEEP_VERSIONS = 8  # probes kept in Redis: a generator that applies a version this late gets none


def probe_ids(chat: ChatTokens, first_record: dict) -> list[int]:
    """The probe sequence: the run's first training record as ``chat`` (the run's encoding) encodes its
    prompt, cut to ``PROBE_TOKENS`` (the same in the learner and every generator)."""
    return chat.prompt_ids(prompt_of(first_record))[:PROBE_TOKENS]


def field(version: int) -> str:
    return f"probe:{version}"


def publish(control, version: int, logprobs: Sequence[float]) -> None:
    """The learner's log-probs of version ``version`` (older probes are dropped)."""
    control.set_meta(field(version), json.dumps([float(x) for x in logprobs]))
    control.forget_meta(field(version - KEEP_VERSIONS))


def difference(control, version: int, logprobs: Sequence[float]) -> float | None:
    """The largest |generator - learner| log-prob over the probe's tokens, or None when the learner's
    probe of ``version`` is not (or no longer) there."""
    stored = control.get_meta(field(version))
    if stored is None:
        return None
    reference = json.loads(stored)
    if len(reference) != len(logprobs):
        raise ValueError(f"probe of version {version}: {len(logprobs)} log-probs, the learner's has {len(reference)}")
    return max((abs(a - b) for a, b in zip(logprobs, reference, strict=True)), default=0.0)
