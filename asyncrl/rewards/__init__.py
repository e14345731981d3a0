"""Rewards: every way a run scores a completion.

* ``resolve``: ``data.reward`` to a callable (``module:function``, an ``http(s)://`` server, ``rm:<dir>``),
  how it is called and what counts as a score. A new kind of reward source goes here.
* ``math_answer``: the math-answer reward (``asyncrl.rewards.math_answer:math_reward``).
* ``remote``: the client of a reward server; ``serve``: ``asyncrl reward-serve``, any reward over HTTP from
  killable worker processes.
* ``model``: a trained reward model (an ``asyncrl rm`` export) as a reward.

A reward of your own needs nothing from here: any ``module:function`` (``reward(prompt, completion, record)``).

May import: the core, asyncrl.learners (the reward model's head), asyncrl.observe.
"""
