"""Errors that reach the user as one line and a non-zero exit, never as a traceback."""


class UserError(Exception):
    """Bad input or environment the user can fix; the message says what and how."""


class EpisodeFailure(Exception):
    """An episode (or its reward) that cannot be scored. ``cause`` names why and is counted; the
    run's failure policy decides what becomes of the group. Never a reward of 0.

    Causes the framework raises: ``env_error``, ``env_timeout``, ``tool_error``, ``tool_timeout``,
    ``reward_error``, ``reward_timeout``, ``reward_invalid``, ``episode_timeout``, ``budget``
    (the episode overran its token budget), ``episode_error`` (the episode's own code raised).
    """

    def __init__(self, cause: str, detail: str = ""):
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause = cause
        self.detail = detail
