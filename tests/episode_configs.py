"""An episode section from keywords, read as a YAML file's ``episode:`` is: its kind named by ``type``, or by
the one key that names the episode (``function``, ``env_url``, ``agent``, ``agent_command``; none:
``completion``). Tests whose kind varies build theirs here; one of a fixed kind names its member class."""

from __future__ import annotations

from pydantic import TypeAdapter

from asyncrl.config import EpisodeConfig

_EPISODE = TypeAdapter(EpisodeConfig)


def episode_config(**fields) -> EpisodeConfig:
    return _EPISODE.validate_python(fields)
