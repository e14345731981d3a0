"""``data``: the prompts, the held-out prompts and the reward that scores them."""

from __future__ import annotations

from pydantic import Field

from asyncrl.config.base import Section


class DataConfig(Section):
    train: str = Field("data/sort/train.jsonl", description="JSONL prompts, one {'prompt', ...} object per line.")
    eval: str | None = Field("data/sort/eval.jsonl", description="Held-out JSONL prompts for greedy evaluation.")
    reward: str = Field(
        "asyncrl.demo.sort:reward",
        description="Reward function as 'module:function', a reward server's http(s) URL, or rm:<dir>, a reward "
        "model that `asyncrl rm` exported (scored in batches in each generator).",
    )
    eval_reward: str | None = Field(
        None, description="Reward of the greedy held-out evaluation, in the same forms (none: data.reward)."
    )
    eval_size: int = Field(128, ge=1, description="Held-out prompts used per evaluation.")
