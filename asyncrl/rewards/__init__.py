"""Rewards: every way a run scores a completion.

* ``resolve``: ``data.reward`` to a callable (``module:function``, an ``http(s)://`` server, ``rm:<dir>``),
  how it is called and what counts as a score. A new kind of reward source goes here.
* ``math_answer``: the math-answer reward (``asyncrl.rewards.math_answer:math_reward``).
* ``remote``: the client of a reward server; ``serve``: ``asyncrl reward-serve``, any reward over HTTP from
  killable worker processes.
* ``model``: a trained reward model (an ``asyncrl rm`` export) as a reward.
* ``batch``: the worker side of batched reward calls (``asyncrl.episodes.user_code.RewardBatch``).

A reward of your own needs nothing from here: any ``module:function`` (``reward(prompt, completion, record)``).

A reward server and the client of one are built from the service kit (``asyncrl.service``).

May import: the core, asyncrl.models (the reward model's head), asyncrl.observe, asyncrl.service.
"""


def __getattr__(name: str):
    """``asyncrl.rewards`` was one module: its names (``load_reward``, ``score``, ...) live in ``resolve`` now."""
    import importlib
    import warnings

    if name.startswith("__") or name == "resolve":  # a submodule not yet imported: the import system asks first
        raise AttributeError(f"module 'asyncrl.rewards' has no attribute {name!r}")
    resolve = importlib.import_module("asyncrl.rewards.resolve")
    if not hasattr(resolve, name):
        raise AttributeError(f"module 'asyncrl.rewards' has no attribute {name!r}")
    warnings.warn(f"asyncrl.rewards.{name} is now asyncrl.rewards.resolve.{name}", FutureWarning, stacklevel=2)
    return getattr(resolve, name)
