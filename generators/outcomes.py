"""From an episode to the wire: each episode's seed, and the sample its context and outcome make."""

from __future__ import annotations

import numpy as np

from asyncrl.episodes.api import Context, Outcome
from asyncrl.protocol import Sample


def episode_seed(run_seed: int, seq: int, sample: int) -> int:
    """The seed of sample ``sample`` of group ``seq`` (-1: evaluations): the same in every run of the
    same seed, well mixed (a CRC's low bits follow its input's)."""
    return int(np.random.SeedSequence([run_seed & (2**64 - 1), seq + 1, sample]).generate_state(1)[0])


def to_sample(ctx: Context, outcome: Outcome) -> Sample:
    """The wire sample of one episode; a failed one keeps its tokens and status, reward 0 (the learner
    leaves it out: its reward is never used)."""
    return Sample(
        tokens=np.asarray(ctx.tokens, dtype=np.int32),
        logprobs=np.asarray(ctx.logprobs, dtype=np.float32),
        versions=np.asarray(ctx.versions, dtype=np.int32),
        reward=0.0 if outcome.reward is None else outcome.reward,
        finish_reason=ctx.finish_reason,
        mask=np.asarray(ctx.mask, dtype=np.uint8),
        status=outcome.status,
        turns=ctx.turns,
        turn_rewards=turn_rewards_array(ctx) if ctx.turn_rewards and outcome.parts else None,
        routes=ctx.routes,
    )


def turn_rewards_array(ctx: Context) -> np.ndarray:
    """(T,) each credited turn's reward at its last model token."""
    out = np.zeros(len(ctx.tokens), dtype=np.float32)
    for index, reward in ctx.turn_rewards:
        out[index] += reward
    return out
