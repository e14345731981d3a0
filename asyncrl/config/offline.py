"""Configuration of the offline training modes (``asyncrl sft``, ``asyncrl rm``, ``asyncrl dpo``).

Their ``model`` and ``learner`` sections are the RL run's (the same DeepSpeed engine: ZeRO stage, lr
schedule, clipping, checkpointing); ``run``, ``data`` and ``train`` are their own. Loaded by
``config.load_config(..., schema=OfflineConfig)``: the same YAML, overrides and error messages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config import LearnerConfig, ModelConfig, Section


class OfflineRunConfig(Section):
    name: str = Field(
        "offline",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Run name; the run directory is out_dir/name (letters, digits, '_', '.', '-').",
    )
    out_dir: str = Field("runs", description="Parent folder of run directories.")
    seed: int = Field(0, description="Seed of the examples' order (a new permutation each epoch).")
    steps: int = Field(100, ge=1, description="Optimizer steps.")
    learners: int = Field(1, ge=1, le=64, description="Learner ranks (one torch.distributed group on this host).")
    eval_every: int = Field(25, ge=0, description="Held-out evaluation every this many steps (0: first and last).")
    overwrite: bool = Field(False, description="Start over in an existing run directory of the same name.")


class OfflineDataConfig(Section):
    train: str | None = Field(
        None,
        description="JSONL examples. sft: {'prompt', 'response'} or chat {'messages'} (the last one the "
        "assistant's, the response); rm and dpo: {'prompt', 'chosen', 'rejected'} (prompt a string or messages).",
    )
    eval: str | None = Field(None, description="Held-out JSONL examples of the same form.")
    eval_size: int = Field(128, ge=1, description="Held-out examples used per evaluation.")
    reward: str | None = Field(
        None,
        description="sft and dpo: a reward as a launch's data.reward names one (module:function, URL, "
        "rm:<dir>), scored on greedy completions of the held-out prompts at each evaluation; none: no generation.",
    )
    chat_template: bool = Field(
        True, description="Render prompts through the tokenizer's chat template when it has one."
    )
    system_prompt: str | None = Field(None, description="System message of templated prompts.")
    max_len: int = Field(
        512, ge=2, description="Most tokens of one prompt plus response; a longer example is an error naming its line."
    )


class TrainConfig(Section):
    batch_size: int = Field(
        16, ge=1, description="Examples per optimizer step, summed over ranks (sft: sequences; rm, dpo: pairs)."
    )
    max_new_tokens: int = Field(16, ge=1, description="Length limit of the greedy evaluation completions.")
    dpo_beta: float = Field(0.1, gt=0, description="dpo: beta, the strength of the pull toward the reference.")
    dpo_loss: Literal["sigmoid", "ipo"] = Field(
        "sigmoid",
        description="dpo: sigmoid (DPO, on summed log-probs) or ipo (IPO, on per-token mean log-probs).",
    )


class OfflineConfig(Section):
    run: OfflineRunConfig = OfflineRunConfig()
    model: ModelConfig = ModelConfig()
    learner: LearnerConfig = LearnerConfig()
    data: OfflineDataConfig = OfflineDataConfig()
    train: TrainConfig = TrainConfig()

    @model_validator(mode="after")
    def _cross_field(self) -> OfflineConfig:
        if self.data.train is None:
            raise ValueError("data.train is required: the JSONL examples to train on")
        if self.train.batch_size % self.run.learners:
            raise ValueError(
                f"train.batch_size ({self.train.batch_size}) must be divisible by run.learners ({self.run.learners})"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name
