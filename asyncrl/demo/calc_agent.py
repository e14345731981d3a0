"""The calc task (``asyncrl.demo.calc``) as an OpenAI function-calling agent: ``tools=[calc]``, the
calls run here, their results sent back as ``role: tool`` messages. It imports nothing from asyncrl:
train it with ``episode.agent: asyncrl.demo.calc_agent:play`` and ``episode.tool_parser: simple``
(configs/demo-calc-agent.yaml; the tiny model writes ``<call>calc 37*58</call>``, which the endpoint
returns as an OpenAI ``tool_calls`` entry).

One round, as the ``ctx`` version: a turn; if it calls tools, their results as one tool message
(``;``-joined, ``;``-ended, cut to 24 characters) and one more turn. The agent returns nothing: the
run's ``data.reward`` scores the last turn.
"""

from __future__ import annotations

import json
import re

OBS_CHARS = 24
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate integer arithmetic exactly: + - * and parentheses, e.g. 37*58.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
_TERM = re.compile(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*")


def calculate(expression: str) -> str:
    """``a op b`` for integers and + - *; an error text for anything else."""
    match = _TERM.fullmatch(expression)
    if match is None:
        return "error: calc: ValueError: not arithmetic"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


async def play(client, task: dict) -> None:
    messages = [{"role": "user", "content": task["prompt"]}]
    response = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    message = response.choices[0].message
    if message.tool_calls:
        results = [calculate(json.loads(c.function.arguments).get("expression", "")) for c in message.tool_calls]
        messages.append(message.model_dump(exclude_none=True))
        content = ";".join(results)[: OBS_CHARS - 1] + ";"
        messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": content})
        await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    return None
