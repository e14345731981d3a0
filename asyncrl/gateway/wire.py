"""The OpenAI wire shapes of the agent endpoint (``asyncrl.gateway.server``): which request
parameters are served, and the answers' JSON (chat and text completions, their log-probs, a stream's
chunks)."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from asyncrl.gateway.transcript import Answer, BadRequest

MODEL = "policy"  # the one model GET /models lists (a request may name any: the run's policy answers)
# Parameters by what the endpoint does with them: served; accepted and not applied (the run's sampling
# applies, see the server's docstring); accepted only at their neutral value.
CHAT = {"model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "stop", "n", "logprobs"}
COMPLETION = {"model", "prompt", "max_tokens", "stop", "n", "logprobs"}
IGNORED = {
    "temperature",
    "top_p",
    "user",
    "seed",
    "metadata",
    "store",
    "parallel_tool_calls",
    "stream",
    "stream_options",
}
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "top_logprobs": 0, "echo": False, "best_of": 1}


def check_params(body: dict, known: set[str]) -> None:
    """:class:`BadRequest` for a parameter the endpoint does not serve, or a value it cannot honour."""
    for name, value in body.items():
        if name in NEUTRAL:
            if value not in (None, NEUTRAL[name]):
                raise BadRequest(f"{name}={value!r} is not supported", "unsupported_parameter", name)
        elif name not in known and name not in IGNORED:
            raise BadRequest(f"unsupported parameter: {name!r}", "unsupported_parameter", name)
    if body.get("n") not in (None, 1):
        raise BadRequest("n must be 1: each episode is one sample", "unsupported_parameter", "n")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise BadRequest("max_tokens must be a positive integer", "invalid_value", "max_tokens")


def stops(body: dict) -> list[str]:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a string or a list of strings", "invalid_value", "stop")
    return stop


def chat_body(answer: Answer, model: str, tok, logprobs: bool) -> dict:
    calls = [
        {"id": cid, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for cid, c in zip(answer.call_ids, answer.calls, strict=True)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if calls:
        message["tool_calls"] = calls
    choice = {"index": 0, "message": message, "finish_reason": answer.finish_reason, "logprobs": None}
    if logprobs:
        choice["logprobs"] = {"content": token_logprobs(answer, tok)}
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        **_common(answer, model),
        "choices": [choice],
    }


def completion_body(answer: Answer, model: str, tok, logprobs: bool) -> dict:
    choice: dict[str, Any] = {"index": 0, "text": answer.content or "", "finish_reason": answer.finish_reason}
    choice["logprobs"] = None
    if logprobs:
        entries = token_logprobs(answer, tok)
        choice["logprobs"] = {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
        }
    return {
        "id": f"cmpl-{secrets.token_hex(12)}",
        "object": "text_completion",
        **_common(answer, model),
        "choices": [choice],
    }


def _common(answer: Answer, model: str) -> dict:
    n = len(answer.turn.token_ids)
    usage = {"prompt_tokens": answer.prompt_tokens, "completion_tokens": n, "total_tokens": answer.prompt_tokens + n}
    return {"created": int(time.time()), "model": model, "usage": usage}


def token_logprobs(answer: Answer, tok) -> list[dict]:
    """Each sampled token (the end-of-turn token included) with its behaviour log-prob."""
    out = []
    for t, lp in zip(answer.turn.token_ids, answer.logprobs, strict=True):
        text = tok.decode([t])
        out.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return out


def stream_chunks(full: dict, chat: bool) -> list[dict]:
    if not chat:
        return [{**full, "usage": None}, {**full, "choices": [], "usage": full["usage"]}]
    choice = full["choices"][0]
    delta = dict(choice["message"])
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta["tool_calls"])]
    head = {k: full[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    first = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}]}
    last = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]}
    return [first, last, {**head, "choices": [], "usage": full["usage"]}]


def answer_body(answer: Answer, body: dict, tok, chat: bool) -> dict:
    build = chat_body if chat else completion_body
    return build(answer, str(body.get("model") or MODEL), tok, bool(body.get("logprobs")))


def events(full: dict, chat: bool) -> bytes:
    """A streamed answer's server-sent events: the whole turn in one chunk, then ``[DONE]``."""
    lines = [b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in stream_chunks(full, chat)]
    return b"".join([*lines, b"data: [DONE]\n\n"])
