"""The guess task's agent (asyncrl/demo/guess_agent.py) as a program, the way a command-line agent is written:
the synchronous ``openai`` client from ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, the task as JSON on standard
input, the reward POSTed to ``ASYNCRL_REWARD_URL``. Train it with ``episode.type: agent_command`` and
``episode.agent_command: python scripts/agents/guess_cli.py`` (scripts/bench/agent_command.py measures it
against the in-process agent). From asyncrl it takes the game's rules alone (``asyncrl.demo.guess_agent``,
which imports nothing: ~0.05 s of the program's start, against ~1 s for ``openai``)."""

from __future__ import annotations

import json
import os
import sys

import httpx
import openai

from asyncrl.demo.guess_agent import MAX_TOKENS, MAX_TURNS, answer


def main() -> None:
    task = json.load(sys.stdin)
    client = openai.OpenAI(max_retries=0)
    secret, reward = int(task["secret"]), 0.0
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(MAX_TURNS):
        r = client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS)
        text = r.choices[0].message.content or ""
        reply = answer(secret, text)
        if reply is None:
            reward = 1.0
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": reply}]
    key = os.environ["OPENAI_API_KEY"]
    httpx.post(os.environ["ASYNCRL_REWARD_URL"], json={"reward": reward}, headers={"Authorization": f"Bearer {key}"})


if __name__ == "__main__":
    main()
