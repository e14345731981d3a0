"""Episodes: what one sample of a group is, from a single completion to a long agentic episode.

* ``api``: the episode API (``Context``, ``env_episode``, ``tool_episode``, ``run_episode``, outcomes and
  their causes); re-exported here, so ``from asyncrl.episodes import Context`` is the public spelling.
* ``kinds``: each ``episode.type`` and the builder of its episode; ``load_episode`` (re-exported here).
* ``tools``: tools an episode's model may call (``@tool``) and the tool-call parsers; ``sandbox``: the
  built-in ``python`` tool, model-written code in a fresh, limited, network-less subprocess.
* ``user_code``: where each piece of user code runs (``async`` on the event loop, plain in the service kit's
  killable worker processes, :class:`asyncrl.service.pool.WorkerPool`).
* ``env_serve``: ``asyncrl env-serve``, environment sessions over HTTP from worker processes;
  ``remote_env``: its client, the environment of a run with ``episode.type: remote_env``.
* ``openenv``: OpenEnv environment servers as environments (``OpenEnvEnv``).

Agents over the OpenAI API are a kind of episode too, built by the OpenAI gateway (``asyncrl.gateway``),
which sits above this package: ``kinds`` names its builder by path. Chat tokens (``asyncrl.chat``) are core:
the offline modes and the weight-sync probe use them too.

May import: the core, asyncrl.service, asyncrl.rewards.
"""

from asyncrl.episodes.api import (
    Context,
    Env,
    Episode,
    Outcome,
    env_episode,
    run_episode,
    tool_episode,
)
from asyncrl.episodes.kinds import load_episode
from asyncrl.episodes.openenv import OpenEnvEnv

__all__ = [
    "Context",
    "Env",
    "Episode",
    "OpenEnvEnv",
    "Outcome",
    "env_episode",
    "load_episode",
    "run_episode",
    "tool_episode",
]
