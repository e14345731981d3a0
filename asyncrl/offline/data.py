"""The offline modes' examples: JSONL records checked and tokenized once, by the launcher's preflight and
by each rank, errors naming the file and line.

* sft: ``{"prompt": str, "response": str}``, or ``{"messages": [...]}`` whose last message is the
  assistant's reply (the response; the messages before it are the prompt).
* rm, dpo: ``{"prompt": str | messages, "chosen": str, "rejected": str}``.

A prompt is rendered as a launch renders it (``chat.ChatTokens``: the chat template and generation
prompt by default); a response is its tokens and the token that ends the model's turn.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from asyncrl.chat import ChatTokens
from asyncrl.data import numbered_jsonl
from asyncrl.errors import UserError


@dataclasses.dataclass(frozen=True)
class Example:
    prompt_ids: list[int]
    responses: tuple[list[int], ...]  # sft: (response,); rm, dpo: (chosen, rejected)
    prompt: str | list[dict]  # as written: what a reward function and greedy evaluation take
    record: dict


def _messages_problem(messages: object) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {'role': ..., 'content': ...} objects"
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"messages[{i}] must be an object with string 'role' and 'content'"
    return None


def record_problem(mode: str, rec: object) -> str | None:
    """What is wrong with one line of a ``mode`` dataset, or None."""
    if not isinstance(rec, dict):
        return "each line must be a JSON object"
    if mode == "sft" and "messages" in rec:
        wrong = _messages_problem(rec["messages"])
        if wrong:
            return wrong
        if len(rec["messages"]) < 2 or rec["messages"][-1]["role"] != "assistant":
            return "'messages' must end with the assistant's reply after at least one message"
        return None
    fields = ("prompt", "response") if mode == "sft" else ("prompt", "chosen", "rejected")
    missing = [f for f in fields if f not in rec]
    if missing:
        forms = "'prompt' and 'response', or chat 'messages'" if mode == "sft" else "'prompt', 'chosen' and 'rejected'"
        return f"missing {', '.join(repr(f) for f in missing)}: a {mode} example has {forms}"
    prompt = rec["prompt"]
    if not isinstance(prompt, str):
        wrong = _messages_problem(prompt)
        if wrong:
            return f"'prompt' must be a string or chat messages: {wrong}"
    for f in fields[1:]:
        if not isinstance(rec[f], str):
            return f"{f!r} must be a string"
    return None


def load_examples(path: str | Path, mode: str, chat: ChatTokens, max_len: int) -> list[Example]:
    """Every example of ``path``, tokenized; a UserError for a bad line or one longer than ``max_len``."""
    examples = []
    for line, rec in numbered_jsonl(path, lambda rec: record_problem(mode, rec)):
        if mode == "sft" and "messages" in rec:
            prompt, texts = rec["messages"][:-1], (rec["messages"][-1]["content"],)
        elif mode == "sft":
            prompt, texts = rec["prompt"], (rec["response"],)
        else:
            prompt, texts = rec["prompt"], (rec["chosen"], rec["rejected"])
        prompt_ids = chat.prompt_ids(prompt)
        responses = tuple(chat.response_ids(t) for t in texts)
        longest = len(prompt_ids) + max(len(r) for r in responses)
        if longest > max_len:
            raise UserError(f"{path}:{line}: {longest} tokens (prompt and response), more than data.max_len={max_len}")
        examples.append(Example(prompt_ids, responses, prompt, rec))
    if not examples:
        raise UserError(f"dataset file is empty: {path}")
    return examples
