"""Episodes: what one sample of a group is, from a single completion to a long agentic episode.

* ``api``: the episode API (``Context``, ``env_episode``, ``tool_episode``, ``run_episode``, outcomes and
  their causes); re-exported here, so ``from asyncrl.episodes import Context`` is the public spelling.
* ``tools``: tools an episode's model may call (``@tool``) and the tool-call parsers.

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

__all__ = ["Context", "Env", "Episode", "Outcome", "env_episode", "load_episode", "run_episode", "tool_episode"]
