"""Reward functions: where they come from, how they are called, and what counts as a score.

``data.reward`` names the reward: ``'module:function'`` (a Python callable, plain or ``async``) or an
``http(s)://.../score`` URL (a remote reward server, see ``asyncrl.rewards.remote``). Either way the
generator calls it as ``reward(prompt, completion, record)`` through :func:`score`, which is the one
place where a reward's result is judged:

* a finite number is a reward; a mapping of names to finite numbers is a reward in named parts
  (their sum is the reward; each part is logged as ``reward/<name>``);
* anything else (a string, None, NaN, an infinity) is ``reward_invalid``; a raised exception is
  ``reward_error``; no answer within ``timeout_s`` is ``reward_timeout``. Each is an
  :class:`~asyncrl.errors.EpisodeFailure`: counted by cause, never scored as 0.

In a generator a plain function runs in a worker process of the generator's pool (killed and replaced
when it hangs past ``timeout_s``: ``reward_timeout``; ``reward_crash`` / ``reward_memory`` when it dies),
so a slow one never blocks the generator's event loop and a hung one holds nothing; called elsewhere
(offline evaluation) it runs on a thread. To share rewards across generators or machines, serve the
function with ``asyncrl reward-serve``, which runs it in replaceable worker processes too.
"""

from __future__ import annotations

import math
import numbers
import traceback
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from asyncrl.data import call_bounded, import_by_path, is_async
from asyncrl.errors import EpisodeFailure

if TYPE_CHECKING:  # a reward worker imports this module: it needs no config (pydantic)
    from asyncrl.config.data import DataConfig

Reward = float | dict[str, float]
RewardFn = Callable[[str, str, dict], "Reward | Awaitable[Reward]"]


def load_reward(spec: str, timeout_s: float) -> RewardFn:
    """The reward ``spec`` names: an import path, or a remote server's URL (called with ``timeout_s``
    per request)."""
    if spec.startswith(("http://", "https://")):
        from asyncrl.rewards.remote import RemoteReward

        return RemoteReward(spec, timeout_s=timeout_s)
    from asyncrl.rewards.model import PREFIX, RewardModelReward

    if spec.startswith(PREFIX):  # an `asyncrl rm` export, loaded at its first call
        return RewardModelReward(spec.removeprefix(PREFIX))
    return import_by_path(spec)


class RunRewards:
    """A run's rewards, each named one loaded once (:func:`load_reward`): each train source's (its own, else
    ``data.reward``) and each eval set's (its own, else ``data.eval_reward``, else ``data.reward``)."""

    def __init__(self, data: DataConfig, timeout_s: float):
        train, held_out = data.reward_specs
        self.loaded = {spec: load_reward(spec, timeout_s) for spec in dict.fromkeys([*train, *held_out]) if spec}
        self.train = [self.loaded[spec] for spec in train]  # by source
        self.eval = [self.loaded[spec] if spec else None for spec in held_out]  # by eval set (data.eval_sets)

    def metrics(self) -> dict[str, float]:
        """What the rewards that measure themselves report (a reward model's throughput)."""
        return {k: v for fn in self.loaded.values() for k, v in getattr(fn, "metrics", dict)().items()}

    async def aclose(self) -> None:
        """Close the connections of those that hold some (a remote reward's)."""
        for fn in self.loaded.values():
            if (close := getattr(fn, "close", None)) is not None and is_async(close):
                await close()


async def score(
    fn: RewardFn, prompt: str, completion: str, record: dict, timeout_s: float, call: Callable = call_bounded
) -> dict[str, float]:
    """``fn(prompt, completion, record)`` judged (see the module doc): the reward's named parts, one
    part named ``reward`` for a plain number. Raises :class:`EpisodeFailure`. ``call`` runs ``fn``: an
    episode's runs plain rewards in the generator's worker processes (``asyncrl.episodes.user_code``)."""
    try:
        value = await call(fn, timeout_s, prompt, completion, record)
    except TimeoutError:
        raise EpisodeFailure("reward_timeout", f"no score within {timeout_s:g} s") from None
    except EpisodeFailure:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's reward: any error is data, not a crash
        raise EpisodeFailure("reward_error", one_line(exc)) from exc
    return reward_parts(value)


def reward_parts(value: object) -> dict[str, float]:
    """A reward's result as named finite parts; :class:`EpisodeFailure` ``reward_invalid`` otherwise."""
    if isinstance(value, Mapping):
        parts = {str(k): _finite(v, f"part {k!r}") for k, v in value.items()}
        if not parts:
            raise EpisodeFailure("reward_invalid", "an empty mapping of reward parts")
        return parts
    return {"reward": _finite(value, "the reward")}


def _finite(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise EpisodeFailure("reward_invalid", f"{what} is a {type(value).__name__} ({value!r:.60}), not a number")
    number = float(value)
    if not math.isfinite(number):
        raise EpisodeFailure("reward_invalid", f"{what} is {number}")
    return number


def one_line(exc: BaseException) -> str:
    """``Type: message (file:line)`` of where ``exc`` was raised: enough to find it in one line."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"
