"""Episodes: what one sample of a group is, from a single completion to a long agentic episode.

* ``api``: the episode API (``Context``, ``env_episode``, ``tool_episode``, ``run_episode``, outcomes and
  their causes); re-exported here, so ``from asyncrl.episodes import Context`` is the public spelling.
* ``tools``: tools an episode's model may call (``@tool``) and the tool-call parsers; ``sandbox``: the
  built-in ``python`` tool, model-written code in a fresh, limited, network-less subprocess.
* ``user_code``: where each piece of user code runs (``async`` on the event loop, plain in ``pool``: the
  generator's killable worker processes, whose side of the wire is ``pool_worker``).
* ``env_serve``: ``asyncrl env-serve``, environment sessions over HTTP from worker processes;
  ``remote_env``: its client, the environment of a run with ``episode.env_url``.
* ``openenv``: OpenEnv environment servers as environments (``OpenEnvEnv``).
* ``agent``: OpenAI-API agents as episodes (``episode.agent`` / ``agent_command``), each against its own
  session of the generator's OpenAI-compatible endpoint (``openai_server``), whose requests
  ``transcript`` matches against the episode's sample (only new messages encoded; rewrites fork).

Chat tokens (``asyncrl.chat``) are core: the offline modes and the weight-sync probe use them too.

May import: the core, asyncrl.rewards.
"""

from asyncrl.episodes.api import (
    Context,
    Env,
    Episode,
    Outcome,
    env_episode,
    load_episode,
    run_episode,
    tool_episode,
)
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
