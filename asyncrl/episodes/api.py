"""The episode API: what one sample of a group is, from a single completion to a long agentic episode.

An **episode** is an ``async`` function given a :class:`Context`; it returns a reward (a number, or a
mapping of named parts that sum to it)::

    async def episode(ctx):
        turn = await ctx.generate()            # one model turn: the engine's tokens, kept as sampled
        for _ in range(3):
            calls = ctx.tool_calls(turn.text)
            if not calls:
                break
            ctx.observe("\\n".join([await ctx.call_tool(c) for c in calls]), role="tool")
            turn = await ctx.generate()
        return await ctx.score(turn.text)      # the run's data.reward on the final answer

Or a gym-shaped :class:`Env` (``reset(task, seed)``, ``step(action) -> observation, reward, done,
info``, ``close()``; async or plain), which :func:`env_episode` wraps into one; its per-turn rewards
sum to the episode's. ``episode.function`` in the config names either by import path. An Env whose
state lives outside the generator (``RemoteEnv``: a session in ``asyncrl env-serve``) may also have
``journal() -> dict | None`` and ``resume(state)``: then its episodes outlive their generator
(``asyncrl.generators.journal``): after each completed turn the episode's state is kept, and a
generator that takes the group over goes on from there. Each episode
gets its own Env instance; nothing is shared between episodes. Where each piece of user code runs
(``async`` on the event loop, plain in killable worker processes) is ``asyncrl.episodes.user_code``'s.

Tokens: the sample is the prompt's ids, then every model turn's tokens as the engine sampled them
(mask 1, their behaviour log-probs, the version of the weights that produced each), with every
observation's tokens between them (mask 0, log-prob 0, version -1; see ``asyncrl.chat``). Text is
decoded for the episode's code, never encoded back into the sample.

Failures: anything that keeps an episode from an honest score raises
:class:`~asyncrl.errors.EpisodeFailure` with a cause; :func:`run_episode` also turns the episode's own
exceptions (``episode_error``) and overruns of ``episode.episode_timeout_s`` (``episode_timeout``) into
one. Time queued for the engine never counts against an episode's timeout: only its own time does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.chat import Completion, stop_at
from asyncrl.data import prompt_of
from asyncrl.episodes.tools import Tool, ToolCall
from asyncrl.episodes.user_code import LocalEnv, PooledEnv, caller
from asyncrl.errors import EpisodeFailure
from asyncrl.rewards import resolve as rewards
from asyncrl.service.pool import WorkerPool

if TYPE_CHECKING:
    from asyncrl.chat import ChatTokens
    from asyncrl.config import EpisodeConfig

Complete = Callable[[list[int], int], Awaitable[Completion]]  # (context ids, max new tokens) -> one turn
Episode = Callable[["Context"], Awaitable["rewards.Reward"]]


@dataclasses.dataclass(frozen=True)
class ModelTurn:
    text: str  # decoded for the episode's code (special tokens dropped)
    token_ids: list[int]  # as sampled; the end-of-turn token included when the model stopped
    finish_reason: str  # "stop" | "length"


class Context:
    """One episode's handle on the model, its tools and its record. Built by the generator."""

    # the record: the sample, token by token, and its turns (what :meth:`snapshot` keeps)
    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turns: int
    finish_reason: str
    turn_rewards: list[tuple[int, float]]  # (index of a turn's last model token, its reward)
    tool_failures: collections.Counter[str]
    _last_turn: list[int]  # the last model turn's tokens, until an observation follows it

    def __init__(
        self,
        *,
        task: dict,
        seed: int,
        prompt_ids: list[int],
        complete: Complete,
        chat: ChatTokens,
        stop: Sequence[str] = (),
        budget: int,
        max_new_tokens: int,
        cfg: EpisodeConfig,
        tools: dict[str, Tool],
        parser: Callable[[str, dict[str, Tool]], list[ToolCall]],
        reward: rewards.RewardFn,
        pool: WorkerPool | None = None,
    ):
        """``budget``: tokens the episode may add after its prompt (model and observation tokens);
        ``stop``: the run's stop strings (a turn's text ends at the first); ``pool``: where plain
        environments, tools and rewards run (None: on threads)."""
        self.task, self.seed, self.prompt_ids = task, seed, prompt_ids
        self._complete, self._chat, self._budget, self._max_new = complete, chat, budget, max_new_tokens
        self._stop = tuple(stop)
        self._cfg, self.tools, self._parser, self._reward = cfg, tools, parser, reward
        self._pool = pool
        self._env_call, self._tool_call = caller(pool, "env"), caller(pool, "tool")
        self._reward_call = caller(pool, "reward", batched=cfg.batch_rewards)
        self.options = cfg.options  # the run's episode.options
        self.restart()  # an empty record
        # accounting
        self.engine_seconds = 0.0  # waiting for model turns (excluded from the episode's timeout)
        self.env_seconds: list[float] = []  # each environment step's duration
        self._engine_since: float | None = None  # a turn waits for the engine since then
        # outliving the generator (asyncrl.generators.journal): where to keep this episode's state after
        # each turn, the state it resumes from, and whether a cancellation hands it over (keep its session)
        self.keep: Callable[[dict], None] | None = None
        self.resumed: dict | None = None
        self.hand_over = False

    # names of the sample's fields: a snapshot of them is the episode's record so far
    _RECORD = ("tokens", "mask", "logprobs", "versions", "turns", "finish_reason", "turn_rewards", "_last_turn")

    def snapshot(self) -> dict:
        """The episode's record so far (its tokens, mask, log-probs, versions, turns, turn rewards,
        tool failures), JSON-able; :meth:`restore` takes it back exactly."""
        return {**{k: getattr(self, k) for k in self._RECORD}, "tool_failures": dict(self.tool_failures)}

    def restart(self) -> None:
        """An empty record: the episode's start (or its start again)."""
        self.tokens, self.mask, self.logprobs, self.versions = [], [], [], []
        self.turns, self.finish_reason, self.turn_rewards = 0, "stop", []
        self.tool_failures, self._last_turn = collections.Counter(), []
        self.routes = None  # the last turn's routed experts (rollout routing replay), until the sample is made

    def restore(self, record: dict) -> None:
        for k in self._RECORD:
            setattr(self, k, record[k])
        self.turn_rewards = [(int(i), float(r)) for i, r in self.turn_rewards]
        self.tool_failures = collections.Counter(record["tool_failures"])

    def own_seconds(self, since: float) -> float:
        """Wall time since ``since`` (a ``perf_counter``) less the time turns waited for the engine."""
        now = time.perf_counter()
        waiting = now - self._engine_since if self._engine_since is not None else 0.0
        return now - since - self.engine_seconds - waiting

    @contextlib.contextmanager
    def waiting(self):
        """Time inside is the run's, not the episode's (a turn's wait for the engine, an agent program's for a
        slot): left out of its timeout (``own_seconds``) and counted in ``engine_seconds``."""
        self._engine_since = time.perf_counter()
        try:
            yield
        finally:
            self.engine_seconds += time.perf_counter() - self._engine_since
            self._engine_since = None

    @property
    def chat(self) -> ChatTokens:
        return self._chat  # the run's chat rendering (an OpenAI-API agent's messages go through it too)

    @property
    def step_timeout_s(self) -> float:
        return self._cfg.step_timeout_s

    @property
    def tokens_left(self) -> int:
        return self._budget - len(self.tokens)

    # -- the model ---------------------------------------------------------------------------------
    async def generate(self, max_new_tokens: int | None = None) -> ModelTurn:
        """One model turn from everything so far. :class:`EpisodeFailure` ``budget`` if no token fits."""
        limit = min(max_new_tokens or self._max_new, self.tokens_left)
        if limit <= 0:
            raise EpisodeFailure("budget", f"no room for another turn in {self._budget} tokens")
        with self.waiting():
            c = await self._complete(self.prompt_ids + self.tokens, limit)
        self.tokens += c.tokens
        self.mask += [1] * len(c.tokens)
        self.logprobs += c.logprobs
        self.versions += c.versions
        self.turns += 1
        self.finish_reason = c.finish_reason
        self._last_turn = list(c.tokens)
        self.routes = c.routes  # the whole context's, as this turn's request ran it (its prompt recomputed)
        text = self._chat.tok.decode(c.tokens, skip_special_tokens=True)
        end = stop_at(text, self._stop) if self._stop else None
        return ModelTurn(text[:end], list(c.tokens), c.finish_reason)  # a stop string's last token may hold more

    def reward_turn(self, reward: float) -> None:
        """Credit the last model turn with ``reward``, part of the episode's (token-level estimators
        such as REINFORCE++ and GAE then see it at that turn; group estimators see the total)."""
        last = max((i for i, m in enumerate(self.mask) if m), default=None)
        if last is None:
            raise EpisodeFailure("episode_error", "reward_turn before any model turn")
        self.turn_rewards.append((last, float(reward)))

    # -- the environment ---------------------------------------------------------------------------
    def observe(self, observation: str | Sequence[int], role: str = "user") -> None:
        """Append environment or tool tokens (mask 0): text through the chat template, or ids verbatim."""
        if isinstance(observation, str):
            ids = self._chat.observation_ids(observation, role, after=self._last_turn)
        else:
            ids = [int(t) for t in observation]
        if len(ids) > self.tokens_left:
            raise EpisodeFailure(
                "budget", f"an observation of {len(ids)} tokens overruns the {self._budget}-token budget"
            )
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self._last_turn = []

    async def env_call(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` as one environment step: awaited if async, else in a worker process (or on a
        thread, see ``asyncrl.episodes.user_code``); bounded by ``episode.step_timeout_s``; its errors
        become ``env_error`` / ``env_timeout`` (and ``env_crash`` / ``env_memory`` in a worker)."""
        timeout = self._cfg.step_timeout_s
        t0 = time.perf_counter()
        try:
            return await self._env_call(fn, timeout, *args)
        except TimeoutError:
            raise EpisodeFailure("env_timeout", f"{_name(fn)} took longer than {timeout:g} s") from None
        except EpisodeFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - the environment's error is the episode's data
            raise EpisodeFailure("env_error", rewards.one_line(exc)) from exc
        finally:
            self.env_seconds.append(time.perf_counter() - t0)

    # -- tools ---------------------------------------------------------------------------------------
    def tool_calls(self, text: str) -> list[ToolCall]:
        """The tool calls in a model turn's text, by the run's ``episode.tool_parser``."""
        return self._parser(text, self.tools)

    async def call_tool(self, call: ToolCall | str, **arguments: Any) -> str:
        """Run one tool call; its result as text. A tool that raises, hangs or does not exist is
        counted by cause and, under ``episode.tool_errors: observe``, answered with ``error: ...``
        for the model to read; under ``fail`` it fails the episode."""
        if isinstance(call, str):
            call = ToolCall(call, arguments)
        t0 = time.perf_counter()
        try:
            spec = self.tools.get(call.name)
            if spec is None:
                raise EpisodeFailure("tool_error", f"no tool named {call.name!r}")
            return await spec(call.arguments, spec.timeout_s or self._cfg.tool_timeout_s, call=self._tool_call)
        except EpisodeFailure as failure:
            self.tool_failures[failure.cause] += 1
            if self._cfg.tool_errors == "fail":
                raise
            return f"error: {failure.detail}"
        finally:
            self.env_seconds.append(time.perf_counter() - t0)

    # -- rewards ---------------------------------------------------------------------------------------
    async def score(self, completion: str) -> dict[str, float]:
        """The run's ``data.reward`` of ``completion`` for this task (see ``asyncrl.rewards.resolve``)."""
        prompt = self._chat.prompt_text(prompt_of(self.task))  # chat messages: as the template rendered them
        return await rewards.score(
            self._reward, prompt, completion, self.task, self._cfg.reward_timeout_s, call=self._reward_call
        )

    async def open_env(self, make_env: Callable[[], Env], target: str | None, options: dict) -> LocalEnv | PooledEnv:
        """This episode's environment: a session in the pool when ``target`` names a plain environment
        class and the run has a pool, else ``make_env()`` here."""
        if target is not None and self._pool is not None:
            return await PooledEnv.open(self._pool, target, options, self)
        return LocalEnv(make_env(), self)


# ----------------------------------------------------------------------------------- environments


class Env(Protocol):
    """A gym-shaped environment; any method may be ``async``. One instance per episode."""

    def reset(self, task: dict, seed: int) -> str | None:
        """Start an episode of ``task``; an observation to show before the first turn, or None."""

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        """The model's turn (its text) -> (observation, reward, done, info)."""

    def close(self) -> None: ...


def env_episode(
    make_env: Callable[[], Env], max_turns: int, target: str | None = None, options: dict | None = None
) -> Episode:
    """An episode that plays ``make_env()`` for up to ``max_turns`` model turns; the reward is the
    sum of the per-turn rewards (named ``reward``) or of the named parts a step's ``info['reward_parts']``
    gives, and each turn is credited with its own (``Context.reward_turn``). ``target``: the import
    path of a plain environment class, built with ``options`` in a worker process of the run's pool.

    An environment with ``journal()`` / ``resume()`` is journaled when the generator asks
    (``Context.keep``): after its reset, after each model turn (with the action about to be sent) and
    after each step. Resumed from a journal whose session is gone before its first answer, the
    episode starts again from the beginning, in a new session."""

    async def episode(ctx: Context) -> dict[str, float]:
        env = await ctx.open_env(make_env, target, options or {})
        user_env = env.env if isinstance(env, LocalEnv) else None
        journaled = user_env if ctx.keep is not None and callable(getattr(user_env, "journal", None)) else None
        try:
            if journaled is not None and ctx.resumed is not None:
                journaled.resume(ctx.resumed["env"])
                try:
                    return await _play(ctx, env, max_turns, journaled, ctx.resumed)
                except _SessionGone:
                    ctx.restart()
            return await _play(ctx, env, max_turns, journaled)
        except asyncio.CancelledError:
            if journaled is not None and ctx.hand_over:  # another generator goes on with this session
                env = None
            raise
        finally:
            if env is not None:
                await _quietly(env.close())

    return episode


class _SessionGone(Exception):
    """A resumed episode's session was gone before it answered anything (``env_lost``)."""


async def _play(
    ctx: Context, env: LocalEnv | PooledEnv, max_turns: int, journaled: Any, resumed: dict | None = None
) -> dict[str, float]:
    """The turns of :func:`env_episode`, from the beginning or from ``resumed``; ``journaled``: the
    environment whose ``journal()`` goes into ``ctx.keep`` after each turn (None: nothing is kept)."""
    parts: dict[str, float] = collections.defaultdict(float)
    action: str | None = None  # a model turn's text not yet answered by the environment
    if resumed is not None:
        ctx.restore(resumed["ctx"])
        parts.update(resumed["parts"])
        action = resumed["action"]
    else:
        first = await env.reset(ctx.task, ctx.seed)
        if first:
            ctx.observe(first)

    def keep() -> None:
        if journaled is not None:
            ctx.keep({"ctx": ctx.snapshot(), "parts": parts, "action": action, "env": journaled.journal()})

    keep()
    answered = False
    while action is not None or ctx.turns < max_turns:
        if action is None:
            action = (await ctx.generate()).text
            keep()
        try:
            observation, reward, done, info = _step_result(await env.step(action))
        except EpisodeFailure as failure:
            if resumed is not None and not answered and failure.cause == "env_lost":
                raise _SessionGone from failure
            raise
        answered, action = True, None
        step_parts = rewards.reward_parts((info or {}).get("reward_parts", reward))
        for name, value in step_parts.items():
            parts[name] += value
        ctx.reward_turn(sum(step_parts.values()))
        if done:
            break
        ctx.observe(observation)
        keep()
    return dict(parts) or {"reward": 0.0}


def _step_result(result: Any) -> tuple[Any, float, bool, dict]:
    """``(observation, reward, done, info)`` of a step (a list once it crossed from a worker process)."""
    try:
        observation, reward, done, info = result
    except (TypeError, ValueError):
        raise EpisodeFailure(
            "env_error", f"step() returned {type(result).__name__}, not (observation, reward, done, info)"
        ) from None
    return observation, reward, done, info


async def _quietly(call: Awaitable) -> None:
    try:
        await call
    except EpisodeFailure:  # a failing close() is counted by the step timer, not an episode failure
        pass


# ----------------------------------------------------------------------------------- built-in episodes


async def single_turn(ctx: Context) -> dict[str, float]:
    """One completion scored by ``data.reward``: the classic RLVR sample."""
    return await ctx.score((await ctx.generate()).text)


def tool_episode(max_turns: int) -> Episode:
    """Generate; while the turn calls tools (and turns are left) answer with their results as a
    ``tool`` message and generate again; score the last turn with ``data.reward``."""

    async def episode(ctx: Context) -> dict[str, float]:
        turn = await ctx.generate()
        while ctx.turns < max_turns and (calls := ctx.tool_calls(turn.text)):
            results = [await ctx.call_tool(c) for c in calls]
            ctx.observe("\n".join(results), role="tool")
            turn = await ctx.generate()
        return await ctx.score(turn.text)

    return episode


# ----------------------------------------------------------------------------------- running one


@dataclasses.dataclass
class Outcome:
    """How one episode ended: its reward parts, or the failure (cause, one-line detail, traceback)."""

    parts: dict[str, float] | None
    cause: str | None = None
    detail: str = ""
    traceback: str = ""

    @property
    def status(self) -> str:
        return self.cause or "ok"

    @property
    def reward(self) -> float | None:
        """The episode's reward (its parts' sum); None for a failed one."""
        return None if self.parts is None else sum(self.parts.values())


async def run_episode(episode: Episode, ctx: Context, timeout_s: float) -> Outcome:
    """Run ``episode(ctx)`` to its outcome. The watchdog counts only the episode's own time (wall
    time less the time its turns waited for the engine) against ``timeout_s``."""
    task = asyncio.ensure_future(_judged(episode, ctx))
    start = time.perf_counter()
    try:
        while True:
            left = timeout_s - ctx.own_seconds(start)
            done, _ = await asyncio.wait({task}, timeout=max(left, 0.0) + 0.01)
            if done:
                return task.result()
            if ctx.own_seconds(start) >= timeout_s:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return Outcome(None, "episode_timeout", f"over {timeout_s:g} s of its own time")
    except asyncio.CancelledError:
        task.cancel()
        raise


async def _judged(episode: Episode, ctx: Context) -> Outcome:
    try:
        return Outcome(rewards.reward_parts(await episode(ctx)))
    except EpisodeFailure as failure:
        return Outcome(None, failure.cause, failure.detail, traceback.format_exc())
    except Exception as exc:  # noqa: BLE001 - the episode's own bug fails the episode, not the generator
        return Outcome(None, "episode_error", rewards.one_line(exc), traceback.format_exc())


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", repr(fn))
