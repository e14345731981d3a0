"""``data``: the prompts, the held-out prompts and the reward that scores them. No defaults: a run names its
own (the demos' configs in ``configs/`` name theirs); the core knows no task."""

from __future__ import annotations

from pydantic import Field

from asyncrl.config.base import Section


class DataConfig(Section):
    train: str | None = Field(
        None, description="JSONL prompts, one {'prompt', ...} object per line (a run must name them)."
    )
    eval: str | None = Field(None, description="Held-out JSONL prompts for greedy evaluation (none: no evaluation).")
    reward: str | None = Field(
        None,
        description="Reward function as 'module:function', a reward server's http(s) URL, or rm:<dir>, a reward "
        "model that `asyncrl rm` exported (scored in batches in each generator); a run must name one.",
    )
    eval_reward: str | None = Field(
        None, description="Reward of the greedy held-out evaluation, in the same forms (none: data.reward)."
    )
    eval_size: int = Field(128, ge=1, description="Held-out prompts used per evaluation.")
