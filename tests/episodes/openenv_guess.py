"""A digit-guessing environment written with openenv-core, served by uvicorn for ``test_openenv.py``.

The server: ``python -m uvicorn --factory openenv_guess:make_app --fd N`` (its own process). Each
WebSocket session holds one :class:`GuessEnvironment`: ``reset(seed)`` draws a secret digit from the
seed and answers ``0-9?``; each step reads the first digit of the guess and answers ``hi;`` (the
secret is higher) or ``lo;`` with reward 0.25, ``?;`` (no digit) with 0.0, or ``ok;`` with 1.0, which
ends the episode; so does the last of its ``tries``. Short texts: the demo model's context is 64 tokens.

What the tests read back: with ``$OPENENV_GUESS_LOG`` set, the server appends one JSON line per
step begun (``{"event": "step", ...}``) and one per session closed (``{"event": "close", "reward":
the session's total, ...}``), so a test can match each episode's reward to the server's.

:class:`GuessAdapter` is asyncrl's side (``episode.options.adapter``).
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
import uuid
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app
from pydantic import Field

LOG_ENV = "OPENENV_GUESS_LOG"
SESSIONS_ENV = "OPENENV_GUESS_SESSIONS"  # the server's max_concurrent_envs
TOKEN_ENV = "OPENENV_GUESS_TOKEN"  # set: sessions need "Authorization: Bearer <it>" (a gateway's check)
WRONG_DIGIT = 0.25  # a wrong guess that is a digit earns something: the samples' rewards then vary (exact in binary)
_DIGIT = re.compile(r"\d")
_log_lock = threading.Lock()


class GuessAdapter:
    """asyncrl's side: the model's text is the guess; the observation's ``text`` is what it reads next;
    the task may slow every step (``delay_s``) or limit the tries."""

    def action(self, text: str, task: dict) -> dict:
        return {"guess": text}

    def observation(self, obs: dict) -> str:
        return obs["text"]

    def reset_kwargs(self, task: dict, seed: int) -> dict:
        return {"seed": seed, "delay_s": task.get("delay_s", 0.0), "tries": task.get("tries", 3)}


def log(**record: Any) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with _log_lock, open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_log(path) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


class GuessAction(Action):
    guess: str = Field(..., description="The model's turn; its first digit is the guess.")


class GuessObservation(Observation):
    text: str = Field("", description="What the model reads: 0-9?, hi;, lo;, ?; or ok;.")


class GuessState(State):
    secret: int | None = None
    reward: float = 0.0


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each session's instance holds all of its state

    def __init__(self):
        super().__init__()
        self._state = GuessState(episode_id=uuid.uuid4().hex)
        self._delay_s, self._tries = 0.0, 3

    def reset(self, seed=None, episode_id=None, delay_s: float = 0.0, tries: int = 3, **kwargs) -> GuessObservation:
        self._state = GuessState(episode_id=episode_id or uuid.uuid4().hex, secret=random.Random(seed).randrange(10))
        self._delay_s, self._tries = float(delay_s), int(tries)
        return GuessObservation(text="0-9?")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        state = self._state
        if state.secret is None:
            raise RuntimeError("step before reset")
        log(event="step", episode=state.episode_id, step=state.step_count)
        time.sleep(self._delay_s)  # in the session's own thread: other sessions go on
        state.step_count += 1
        match = _DIGIT.search(action.guess)
        if match and int(match.group()) == state.secret:
            state.reward += 1.0
            return GuessObservation(text="ok;", reward=1.0, done=True)
        if match is None:
            reply, reward = "?;", 0.0
        else:
            reply, reward = ("hi;" if state.secret > int(match.group()) else "lo;"), WRONG_DIGIT
        state.reward += reward
        return GuessObservation(text=reply, reward=reward, done=state.step_count >= self._tries)

    @property
    def state(self) -> GuessState:
        return self._state

    def close(self) -> None:
        state = self._state
        if state.secret is not None:
            log(event="close", episode=state.episode_id, steps=state.step_count, reward=state.reward)


def make_app():
    """The ASGI app (uvicorn ``--factory``): openenv's server, one GuessEnvironment per session, behind
    a bearer-token check of every WebSocket handshake when ``$OPENENV_GUESS_TOKEN`` is set (OpenEnv's
    server checks none; gateways in front of it, such as a private Space's, do)."""
    sessions = int(os.environ.get(SESSIONS_ENV, "64"))
    app = create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=sessions)
    token = os.environ.get(TOKEN_ENV)
    if not token:
        return app
    expected = f"Bearer {token}".encode()

    async def gate(scope, receive, send):
        if scope["type"] == "websocket" and dict(scope["headers"]).get(b"authorization") != expected:
            await send({"type": "websocket.http.response.start", "status": 401, "headers": []})
            await send({"type": "websocket.http.response.body", "body": b'{"error": "no or wrong token"}'})
            return
        await app(scope, receive, send)

    return gate
