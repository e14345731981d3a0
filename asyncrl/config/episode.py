"""``episode``: what one sample is (a single completion, an environment, tools), its budgets and failure limit."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from asyncrl.config.base import Section


class EpisodeConfig(Section):
    function: str | None = Field(
        None,
        description="'module:name' of an async episode function or an Env class (see asyncrl.episodes.api); None: "
        "one completion scored by data.reward, or a tool loop when tools are given.",
    )
    tools: list[str] = Field([], description="'module:name' of each @asyncrl.episodes.tools.tool the model may call.")
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
