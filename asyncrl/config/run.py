"""``run``: the run's name and directory, its size (generators, learners, steps) and the lag knob."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.base import Section


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
        1,
        ge=0,
        le=256,
        description="Generator processes the launcher starts (0: only those that join, see docs/fleet.md).",
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
        description="On CPU-only machines pin learner ranks to the first cores and generators (once their engine "
        "is up) to the next ones, round the cores again when they are fewer (2 cores, 2 + 2: learner r and generator "
        "r on core r), and run generators at generator_nice, so learner collectives never wait behind sampling.",
    )
    generator_nice: int = Field(10, ge=0, le=19, description="Niceness of generators under cpu_scheduling.")
    fork_generators: bool = Field(
        True,
        description="Fork a launch's generators from one process that imported torch, transformers and vLLM "
        "once (Linux; asyncrl.run.forkserver), instead of starting each, and each restart, as a new interpreter "
        "that imports them again (~6 CPU-seconds a generator on CPU).",
    )
    fork_learners: bool = Field(
        True,
        description="On CPU, fork a launch's local learner ranks from one process that imported torch, "
        "transformers and DeepSpeed once (Linux; asyncrl.run.forkserver), instead of starting each, and each "
        "restart, as a new interpreter that imports them again (~5 CPU-seconds a rank). Ranks on GPUs are started.",
    )
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
