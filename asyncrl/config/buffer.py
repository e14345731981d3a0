"""``buffer``: the trajectory buffer, chosen by its ``type`` (redis, or the in-process memory stub)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag

from asyncrl.config.base import Section, type_or


class _BufferBase(Section):
    block_ms: int = Field(200, ge=1, description="How long a blocked read or admission wait sleeps per poll.")
    replay_times: int = Field(
        1, ge=1, description="Train on a group up to this many times (in later steps) while within the lag bound."
    )
    filter_zero_variance: bool = Field(
        False,
        description="DAPO dynamic filtering: drop groups whose rewards are all equal (no GRPO signal) before they "
        "count towards a batch; generation continues until the batch is full.",
    )
    max_frame_mb: float = Field(
        64.0, gt=0, description="Trajectory frames larger than this go to dead letters instead of training."
    )


class RedisBufferConfig(_BufferBase):
    type: Literal["redis"] = Field("redis", description="A real redis-server shared by every process of the run.")
    url: str | None = Field(
        None, description="Use this Redis server instead of starting one (redis://:pw@host:port/db)."
    )


class MemoryBufferConfig(_BufferBase):
    type: Literal["memory"] = Field("memory", description="In-process stub: one process only (tests).")


BufferConfig = Annotated[
    Annotated[RedisBufferConfig, Tag("redis")] | Annotated[MemoryBufferConfig, Tag("memory")],
    Discriminator(type_or("redis")),
]
