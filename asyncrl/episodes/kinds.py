"""Episode kinds: ``episode.type`` -> the builder of its episode, and :func:`load_episode`, the one lookup.

A new kind is a config member in ``asyncrl/config/episode.py`` (its ``type`` and its own fields) and one
entry in :data:`KINDS`. A builder runs once per generator (and in the launcher's preflight), so it imports
and checks what the config names there: a bad path stops the run at launch with one line, not every episode
alike. The agent and remote-environment kinds import their modules only when chosen: a run of another kind
never loads the OpenAI-compatible endpoint or the environment server's client.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncrl.data import import_by_path
from asyncrl.episodes.api import Episode, env_episode, single_turn, tool_episode
from asyncrl.episodes.tools import Tool, load_parser, load_tools
from asyncrl.episodes.user_code import plain_env_target
from asyncrl.errors import UserError

AGENT_EPISODE = "asyncrl.gateway.agent:agent_episode"

if TYPE_CHECKING:
    from asyncrl.config import EpisodeConfig
    from asyncrl.config import episode as config


def _completion(cfg: config.CompletionEpisodeConfig) -> Episode:
    """One completion scored by ``data.reward``; a tool loop when the config gives tools."""
    return tool_episode(cfg.max_turns) if cfg.tools else single_turn


def _function(cfg: config.FunctionEpisodeConfig) -> Episode:
    """The ``async def`` episode, or the Env class wrapped into one, that ``episode.function`` names."""
    obj = import_by_path(cfg.function)
    if inspect.isclass(obj):
        _check_options(obj, cfg.function, cfg.options)
        target = plain_env_target(obj, cfg.function) if cfg.plain_code == "process" else None
        return env_episode(functools.partial(obj, **cfg.options), cfg.max_turns, target, cfg.options)
    if not inspect.iscoroutinefunction(obj):
        raise UserError(f"episode.function {cfg.function!r} must be an `async def` episode or an Env class")
    return obj


def _remote_env(cfg: config.RemoteEnvEpisodeConfig) -> Episode:
    """An environment served by ``asyncrl env-serve``: one session per episode."""
    from asyncrl.episodes.remote_env import RemoteEnv

    make_env = functools.partial(RemoteEnv, cfg.env_url, options=cfg.options, timeout_s=cfg.step_timeout_s)
    return env_episode(make_env, cfg.max_turns)


def _agent(cfg: config.AgentEpisodeConfig | config.AgentCommandEpisodeConfig | config.AgentServiceEpisodeConfig):
    """An OpenAI-API agent: a function, a program, or a service. The OpenAI gateway builds it: that package sits
    above the episodes (its endpoint drives a ``Context``), so it is named here by path, as a plugin, never imported."""
    return import_by_path(AGENT_EPISODE)(cfg)


KINDS: dict[str, Callable[[EpisodeConfig], Episode]] = {
    "completion": _completion,
    "function": _function,
    "remote_env": _remote_env,
    "agent": _agent,
    "agent_command": _agent,
    "agent_service": _agent,
}


def load_episode(cfg: EpisodeConfig) -> tuple[Episode, dict[str, Tool], Callable]:
    """The episode, tools and tool-call parser the config names."""
    tools = load_tools(cfg.tools)
    parser = load_parser(cfg.tool_parser)
    return KINDS[cfg.type](cfg), tools, parser


def _check_options(cls: type, name: str, options: dict) -> None:
    """``episode.options`` must fit the Env class's constructor: else the run stops at launch with one
    line, not with every episode failing alike (``env_error``) until the failure limit trips."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a constructor that hides its signature: its first episode tells
        return
    try:
        signature.bind(**options)
    except TypeError as exc:
        raise UserError(f"episode.options {sorted(options)} do not fit {name}{signature}: {exc}") from None
