"""The guess task (``asyncrl.demo.guess``) as a plain OpenAI-API agent: a loop over
``chat.completions.create``. It imports nothing from asyncrl: run it against any OpenAI-compatible
server, or train it with ``episode.agent: asyncrl.demo.guess_agent:play`` (configs/demo-guess-agent.yaml).

The agent plays the environment's side itself: it knows the task's secret, answers each guess with
``higher;``, ``lower;`` or ``invalid;`` as a user message, and returns 1.0 when a guess is right within
``MAX_TURNS``, else 0.0. Its episodes are token for token the ``Env`` version's (plain encoding).
"""

from __future__ import annotations

import re

MAX_TURNS = 4
MAX_TOKENS = 4  # a guess is 1-2 digits and the end-of-turn token
_NUMBER = re.compile(r"\s*(-?\d{1,6})\s*")


def answer(secret: int, text: str) -> str | None:
    """The reply to one guess, or None when it is right."""
    match = _NUMBER.fullmatch(text)
    if match is None:
        return "invalid;"
    guess = int(match.group(1))
    return None if guess == secret else ("higher;" if secret > guess else "lower;")


async def play(client, task: dict) -> float:
    secret = int(task["secret"])
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS)
        text = response.choices[0].message.content or ""
        reply = answer(secret, text)
        if reply is None:
            return 1.0
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": reply}]
    return 0.0
