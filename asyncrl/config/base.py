"""The base every config section shares: unknown keys are errors, and a loaded config is frozen."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def type_or(default: str):
    """A backend section's discriminator: its ``type`` field, ``default`` when the YAML leaves it out."""

    def discriminate(value: Any) -> str:
        if isinstance(value, dict):
            return value.get("type", default)
        return getattr(value, "type", default)

    return discriminate
