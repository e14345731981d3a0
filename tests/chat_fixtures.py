"""An episode and a reward that write down what the generator gave them, for the chat launch test."""

from __future__ import annotations

import json


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:  # one short line per write: appends from several processes do not interleave
        f.write(json.dumps(record) + "\n")


async def recording_episode(ctx):
    """One turn, scored by the run's reward; first writes the prompt's token ids as the generator built them."""
    _append(ctx.options["log"], {"task": ctx.task, "prompt_ids": ctx.prompt_ids})
    turn = await ctx.generate()
    return await ctx.score(turn.text)


def recording_reward(prompt: str, completion: str, record: dict) -> float:
    """1 for a completion that ends with a stop string or is long, 0 otherwise; writes its arguments."""
    _append(record["reward_log"], {"prompt": prompt, "completion": completion, "chat": "messages" in record})
    return float(completion.endswith(".") or len(completion) > 20)
