"""``episode``: what one sample is (a single completion, an environment, tools), its budgets and failure limit."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from asyncrl.config.base import Section


class EpisodeConfig(Section):
    function: str | None = Field(
        None,
        description="'module:name' of an async episode function or an Env class (see asyncrl.episodes.api); None: "
        "one completion scored by data.reward, or a tool loop when tools are given.",
    )
    env_url: str | None = Field(
        None,
        description="An `asyncrl env-serve` server's URL (http://:TOKEN@host:port, or the token from "
        "$ASYNCRL_ENV_TOKEN): each episode plays one session of its environment there, built with "
        "episode.options (see asyncrl.episodes.remote_env). Not with episode.function.",
    )
    agent: str | None = Field(
        None,
        description="'module:function' of an `async def agent(client, task)` written against the OpenAI API: "
        "client is an openai.AsyncOpenAI on the episode's own session of the generator's OpenAI-compatible "
        "endpoint; it returns the reward, or None for data.reward on the last model turn (see "
        "asyncrl.episodes.agent). Not with episode.function, env_url or agent_command.",
    )
    agent_command: str | list[str] | None = Field(
        None,
        description="A program started per episode (a command line, or its argv) with OPENAI_BASE_URL and "
        "OPENAI_API_KEY set for the episode's session and the task as JSON on its standard input; its reward is "
        "what it POSTs to $ASYNCRL_REWARD_URL, else data.reward on the last model turn.",
    )
    agent_host: str = Field(
        "127.0.0.1",
        description="Address the generator's OpenAI-compatible endpoint listens on (agent episodes); leaving "
        "loopback is explicit. Each session has its own key either way.",
    )
    agent_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="The endpoint's port (0: a free one, logged; a fixed one fits one generator per host).",
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
        description="Stop the run with an error when more than this share of failure_window episodes failed "
        "among a generator's last failure_window (counted by whole groups as they end).",
    )
    failure_window: int = Field(
        400,
        ge=1,
        description="Episodes the failure limit looks back over: many groups, since failures come in whole "
        "groups (at 400 a run whose groups fail at random at 20% stays far under a 50% limit; one at 70% "
        "stops within ~290 episodes).",
    )
    plain_code: Literal["process", "thread"] = Field(
        "process",
        description="Where plain (blocking) environments, tools and rewards run: process = the generator's pool "
        "of killable worker processes (a hang, crash or memory blow-up ends only the episodes it touched); "
        "thread = threads of the generator (no isolation; a hung call keeps its thread). async code runs on the "
        "generator's event loop either way (see asyncrl.episodes.user_code).",
    )
    batch_rewards: bool = Field(
        True,
        description="Plain rewards asked in the same turn of the generator's event loop (a single-turn group's n, "
        "and those of other episodes ending in the same engine step) go to a pool worker as one call. Never changes "
        "an outcome: a batch that fails, and any reward in it that raised, run again alone, so a reward may run "
        "twice for one completion: false for a reward with side effects.",
    )
    workers: int = Field(
        4,
        ge=1,
        description="Worker processes of a generator's pool (started as needed), ~20 MB each. Each hosts many "
        "environment sessions; when a worker dies, its sessions are rebuilt elsewhere by replaying their calls "
        "(deterministic environments, docs/episodes.md), so a crash ends only the episode that caused it.",
    )
    worker_threads: int = Field(
        32,
        ge=1,
        description="Calls one worker process runs at once (its threads): workers x worker_threads plain calls "
        "run concurrently, the rest wait for a free thread (that wait does not count against their timeouts).",
    )
    worker_memory_mb: int | None = Field(
        None,
        ge=16,
        description="A worker process whose resident memory passes this is killed: its calls and sessions "
        "end as env_memory / tool_memory / reward_memory. None: no limit but the machine's.",
    )
    options: dict[str, Any] = Field(
        {}, description="Settings for the episode: keyword arguments of an Env class, ctx.options of a function."
    )

    @model_validator(mode="after")
    def _one_environment(self) -> EpisodeConfig:
        if self.env_url is not None and self.function is not None:
            raise ValueError("episode.env_url and episode.function both name the episode: give one")
        if self.env_url is not None and not self.env_url.startswith(("http://", "https://")):
            raise ValueError(f"episode.env_url must be an http(s):// URL, not {self.env_url!r}")
        named = [k for k in ("function", "env_url", "agent", "agent_command") if getattr(self, k) is not None]
        if len(named) > 1 and set(named) != {"function", "env_url"}:
            raise ValueError(f"episode.{' and episode.'.join(named)} all name the episode: give one")
        if self.agent_command is not None and not (
            self.agent_command.split() if isinstance(self.agent_command, str) else self.agent_command
        ):
            raise ValueError("episode.agent_command is empty")
        return self
