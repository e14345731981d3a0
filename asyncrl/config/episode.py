"""``episode``: what one sample is, chosen by its ``type``, with its budgets and failure limit.

The kinds: ``completion`` (one completion scored by data.reward, or a tool loop when tools are given),
``function`` (an async episode function or an Env class), ``remote_env`` (a session of an ``asyncrl
env-serve`` environment), ``agent`` (an ``async def agent(client, task)`` against the OpenAI API),
``agent_command`` (an agent program per episode) and ``agent_service`` (an agent service, ``asyncrl
agent-serve``, plays each episode). A new kind is a member here (its ``type`` and its own
fields) and one builder in ``asyncrl.episodes.kinds.KINDS``.

``type`` may be left out: the one key that names the episode names its kind (``function``, ``env_url``,
``agent``, ``agent_command``, ``agent_url``; none: ``completion``), as configs did before ``episode.type``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BeforeValidator, Discriminator, Field, model_validator

from asyncrl.config.base import Section
from asyncrl.net import is_loopback, redact_url


class _EpisodeBase(Section):
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


class CompletionEpisodeConfig(_EpisodeBase):
    type: Literal["completion"] = Field(
        "completion", description="One completion scored by data.reward, or a tool loop when tools are given."
    )


class FunctionEpisodeConfig(_EpisodeBase):
    type: Literal["function"] = Field(
        "function", description="An async episode function or an Env class, by import path (see asyncrl.episodes.api)."
    )
    function: str = Field(description="'module:name' of an `async def episode(ctx)` or an Env class.")


class RemoteEnvEpisodeConfig(_EpisodeBase):
    type: Literal["remote_env"] = Field(
        "remote_env",
        description="Each episode plays one session of an environment served by `asyncrl env-serve`, built there "
        "with episode.options (see asyncrl.episodes.remote_env).",
    )
    env_url: str = Field(
        description="The server's URL: http://:TOKEN@host:port, or http://host:port with the token in "
        "$ASYNCRL_ENV_TOKEN."
    )

    @model_validator(mode="after")
    def _http(self) -> RemoteEnvEpisodeConfig:
        if not self.env_url.startswith(("http://", "https://")):
            raise ValueError(f"episode.env_url must be an http(s):// URL, not {self.env_url!r}")
        return self


class _AgentEpisodeBase(_EpisodeBase):
    """An agent against the OpenAI API: each episode has its own session of the generator's endpoint."""

    agent_host: str = Field(
        "127.0.0.1",
        description="Address the generator's OpenAI-compatible endpoint listens on; leaving loopback is "
        "explicit. Each session has its own key either way.",
    )
    agent_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="The endpoint's port (0: a free one, logged; a fixed one fits one generator per host).",
    )
    on_agent_error: Literal["score", "fail"] = Field(
        "score",
        description="An exception the agent raised other than in reaching or being served by the endpoint (the "
        "Agents SDK's ModelBehaviorError on a call it cannot run, arguments that are not JSON, max turns), or an "
        "agent_command's exit status 10: 'score' counts the episode as a failed attempt (agent_error_reward) so "
        "its group trains on it; 'fail' fails it as agent_error, like an unreachable endpoint always does.",
    )
    agent_error_reward: float = Field(0.0, description="The reward of an episode scored under on_agent_error=score.")


class AgentEpisodeConfig(_AgentEpisodeBase):
    type: Literal["agent"] = Field(
        "agent", description="An agent function run on the generator's event loop (see asyncrl.gateway.agent)."
    )
    agent: str = Field(
        description="'module:function' of an `async def agent(client, task)` written against the OpenAI API: "
        "client is an openai.AsyncOpenAI on the episode's own session of the generator's OpenAI-compatible "
        "endpoint; it returns the reward, or None for data.reward on the last model turn."
    )


class AgentCommandEpisodeConfig(_AgentEpisodeBase):
    type: Literal["agent_command"] = Field(
        "agent_command", description="An agent program started per episode (see asyncrl.gateway.agent)."
    )
    agent_command: str | list[str] = Field(
        description="The program (a command line, or its argv), started with OPENAI_BASE_URL and OPENAI_API_KEY "
        "set for the episode's session and the task as JSON on its standard input; its reward is what it POSTs "
        "to $ASYNCRL_REWARD_URL, else data.reward on the last model turn."
    )
    agent_processes: int | None = Field(
        None,
        ge=1,
        description="Agent programs running at once on one generator; an episode past it waits for a slot, that "
        "wait left out of its timeout (null: 2 per CPU core of the generator's host).",
    )

    @model_validator(mode="after")
    def _not_empty(self) -> AgentCommandEpisodeConfig:
        if not (self.agent_command.split() if isinstance(self.agent_command, str) else self.agent_command):
            raise ValueError("episode.agent_command is empty")
        return self


class AgentServiceEpisodeConfig(_AgentEpisodeBase):
    type: Literal["agent_service"] = Field(
        "agent_service",
        description="Each episode is played by an agent service (`asyncrl agent-serve`, or any server of its "
        "protocol; see asyncrl.gateway.agent_remote), against the episode's session of this generator's endpoint.",
    )
    agent_url: str = Field(
        description="The service's URL: http://:TOKEN@host:port, or http://host:port with the token in "
        "$ASYNCRL_AGENT_TOKEN. A service on another host needs episode.agent_host set to an address of this "
        "host it can reach (or 0.0.0.0: the address facing the service is the one it is given)."
    )

    @model_validator(mode="after")
    def _reachable(self) -> AgentServiceEpisodeConfig:
        parts = urlsplit(self.agent_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"episode.agent_url must be an http(s)://host:port URL, not {redact_url(self.agent_url)!r}"
            )
        if is_loopback(self.agent_host) and not is_loopback(parts.hostname):
            raise ValueError(
                f"episode.agent_url is on another host ({parts.hostname}) but the generator's endpoint listens on "
                f"loopback (episode.agent_host {self.agent_host}): set episode.agent_host to this host's address "
                "the service can reach, or 0.0.0.0"
            )
        return self


MEMBERS: dict[str, type[_EpisodeBase]] = {
    m.model_fields["type"].default: m
    for m in (
        CompletionEpisodeConfig,
        FunctionEpisodeConfig,
        RemoteEnvEpisodeConfig,
        AgentEpisodeConfig,
        AgentCommandEpisodeConfig,
        AgentServiceEpisodeConfig,
    )
}
# The key that names each kind's episode: a config without episode.type names its kind by giving one of these
# (the kinds that came before episode.type; a kind added since is named by its type).
NAMING_KEYS = {
    "function": "function",
    "env_url": "remote_env",
    "agent": "agent",
    "agent_command": "agent_command",
    "agent_url": "agent_service",
}


def retype(tree: dict, overrides: dict[str, Any]) -> None:
    """An override that names the episode (``--set episode.function=my_task:Env``) and not its ``type`` makes
    the episode that kind: a ``type`` the config wrote gives way (a run's own config.yaml writes one, and a
    config dumped from a loaded one too), and the key's kind is inferred as if the file had none."""
    named = any(v is not None and k.removeprefix("episode.") in NAMING_KEYS for k, v in overrides.items())
    episode = tree.get("episode")
    if named and "episode.type" not in overrides and isinstance(episode, dict):
        episode.pop("type", None)


def _kind_of(value: Any) -> Any:
    """A YAML episode section with its ``type`` filled in (from the one key that names the episode, when left
    out) and checked against the other kinds' keys, each mistake in one line. A key of another kind left at
    null (an override's ``episode.function=null``), or, without ``type``, at its default (the config.yaml of a
    run launched before episode.type, which wrote every kind's keys), is dropped."""
    if not isinstance(value, dict):
        return value
    named = [key for key in NAMING_KEYS if value.get(key) is not None]
    kind = value.get("type")
    if kind is None and len(named) > 1:
        keys, kinds = _listed([f"episode.{k}" for k in named]), _listed([NAMING_KEYS[k] for k in named], "or")
        raise ValueError(
            f"{keys} {'both' if len(named) == 2 else 'all'} name the episode: give one, or write "
            f"episode.type: {kinds} with its key alone"
        )
    inferred = kind is None
    kind = (NAMING_KEYS[named[0]] if named else "completion") if inferred else kind
    if not isinstance(kind, str) or kind not in MEMBERS:
        raise ValueError(f"episode.type {kind!r} is none of {_listed(list(MEMBERS), 'or')}")
    why = "" if not inferred else f" (named by episode.{named[0]})" if named else " (no key names the episode)"
    own = MEMBERS[kind].model_fields
    fields = {"type": kind}
    for key, given in value.items():
        owners = [t for t, m in MEMBERS.items() if key in m.model_fields and key != "type"]
        if key in own or not owners:  # its own, or no kind's: the member's validation says
            fields[key] = given
        elif given is not None and not (inferred and given == MEMBERS[owners[0]].model_fields[key].default):
            raise ValueError(
                f"episode.{key} is for episode.type: {_listed(owners, 'or')}, not {kind}{why}: "
                f"drop episode.{key} or change the episode's type"
            )
    return fields


def _listed(items: list[str], conjunction: str = "and") -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {conjunction} {items[-1]}"


# _kind_of fills in the type of a YAML section before the union picks its member by it
EpisodeConfig = Annotated[
    CompletionEpisodeConfig
    | FunctionEpisodeConfig
    | RemoteEnvEpisodeConfig
    | AgentEpisodeConfig
    | AgentCommandEpisodeConfig
    | AgentServiceEpisodeConfig,
    Discriminator("type"),
    BeforeValidator(_kind_of),
]
