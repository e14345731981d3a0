"""``POST /responses``: OpenAI's Responses API, as the ``openai`` client and the Agents SDK (its default model)
speak it, served by the same conversation as chat completions (``asyncrl.gateway.transcript``).

A request becomes chat messages, then one model turn exactly as ``/chat/completions`` makes it (the same
token matching, forks, stop and tool-call rules):

* ``instructions`` -> a system message first; ``input`` a string -> one user message; ``input`` items: a
  message (``role`` user / system / developer / assistant, content a string or ``input_text`` /
  ``output_text`` parts), a ``function_call`` (joined to the assistant message before it, as that message's
  tool call), a ``function_call_output`` (a tool message; its ``call_id`` must be a call the input made);
* ``previous_response_id``: a response of this session, whose conversation (its input and its output)
  comes before ``input`` (the session keeps each response's until it ends; ``store`` changes nothing);
* ``tools``: function tools (``{"type": "function", "name", "parameters", ...}``); ``tool_choice`` auto or
  none; ``max_output_tokens``.

The answer is a ``response`` object whose ``output`` is a message item with the turn's text (``output_text``,
with each token's behaviour log-prob when ``include`` asks for ``message.output_text.logprobs``) and a
``function_call`` item per tool call; ``status`` ``incomplete`` (``max_output_tokens``) when the turn hit its
limit. Streamed (``stream: true``), the same response as events: ``response.created``, each item added, its
text as one delta, done, and ``response.completed`` (``response.incomplete`` for an incomplete one).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from asyncrl.gateway.transcript import Answer, BadRequest

RESPONSES = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "previous_response_id",
    "include",
    "stream",
    "store",
    "parallel_tool_calls",
    "temperature",
    "top_p",
    "user",
    "metadata",
    "truncation",
    "text",
    "reasoning",
    "stream_options",
}
LOGPROBS = "message.output_text.logprobs"


def messages_of(body: dict, history: list[dict]) -> list[dict]:
    """The chat messages of a Responses request: ``history`` (its previous response's conversation), its
    instructions and its input."""
    messages = list(history)
    if (instructions := body.get("instructions")) is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string", param="instructions")
        if not history:
            messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise BadRequest("'input' must be a string or a non-empty list of items", param="input")
    calls = {c["id"] for m in messages for c in m.get("tool_calls") or ()}
    for i, item in enumerate(given):
        if (message := _item(item, f"input[{i}]", messages, calls)) is not None:
            messages.append(message)
    return messages


def _item(item: Any, param: str, messages: list[dict], calls: set[str]) -> dict | None:
    """One input item as a chat message; None for a function call joined to the assistant message before it."""
    if not isinstance(item, dict):
        raise BadRequest("each input item must be an object", param=param)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise BadRequest("a message item's role must be user, system, developer or assistant", param=param)
        return {"role": role, "content": _text(item.get("content"), param)}
    if kind == "function_call":
        try:
            call_id, name, arguments = str(item["call_id"]), str(item["name"]), item.get("arguments") or "{}"
            json.loads(arguments)
        except (KeyError, TypeError, ValueError):
            raise BadRequest("a function_call item needs call_id, name and JSON arguments", param=param) from None
        calls.add(call_id)
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        if messages and messages[-1]["role"] == "assistant":
            messages[-1] = {**messages[-1], "tool_calls": [*messages[-1].get("tool_calls", ()), call]}
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        call_id = item.get("call_id")
        if call_id not in calls:
            raise BadRequest(
                f"a function_call_output for call_id {call_id!r}, which no function_call made", param=param
            )
        output = item.get("output")
        return {"role": "tool", "tool_call_id": call_id, "content": _text(output, param)}
    raise BadRequest(f"input item type {str(kind)[:40]!r} is not supported", "unsupported_content", param)


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    parts = ("input_text", "output_text", "text")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in parts for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRequest("only text content is supported (a string, or input_text / output_text parts)",
                     "unsupported_content", param)  # fmt: skip


def tools_of(specs: Any) -> list[dict] | None:
    """Responses function tools in chat-completions shape (``asyncrl.gateway.transcript.request_tools``)."""
    if specs is None:
        return None
    if not isinstance(specs, list) or not all(isinstance(t, dict) and t.get("type") == "function" for t in specs):
        raise BadRequest("'tools' must be a list of function tools", "unsupported_parameter", "tools")
    return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
            for t in specs]  # fmt: skip


def check(body: dict) -> None:
    """:class:`BadRequest` for what the endpoint does not serve (as ``wire.check_params``)."""
    for name in body:
        if name not in RESPONSES:
            raise BadRequest(f"unsupported parameter: {name!r}", "unsupported_parameter", name)
    if body.get("reasoning") not in (None, {}):
        raise BadRequest("reasoning options are not supported", "unsupported_parameter", "reasoning")
    include = body.get("include") or []
    if not isinstance(include, list) or any(i != LOGPROBS for i in include):
        raise BadRequest(f"include supports {LOGPROBS!r} only", "unsupported_parameter", "include")
    limit = body.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise BadRequest("max_output_tokens must be a positive integer", "invalid_value", "max_output_tokens")


def response_body(answer: Answer, body: dict, tok, logprobs: list[dict]) -> dict:
    """The ``response`` object of one turn."""
    output: list[dict] = []
    if answer.content is not None or not answer.calls:
        text = {"type": "output_text", "text": answer.content or "", "annotations": []}
        if LOGPROBS in (body.get("include") or []):
            text["logprobs"] = logprobs
        message = {"type": "message", "id": f"msg_{secrets.token_hex(12)}", "status": "completed"}
        output.append(message | {"role": "assistant", "content": [text]})
    for cid, call in zip(answer.call_ids, answer.calls, strict=True):
        output.append({"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": cid,
                       "name": call.name, "arguments": json.dumps(call.arguments), "status": "completed"})  # fmt: skip
    n = len(answer.turn.token_ids)
    cut = answer.finish_reason == "length"
    return {
        "id": f"resp_{secrets.token_hex(12)}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": str(body.get("model") or "policy"),
        "instructions": body.get("instructions"),
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "previous_response_id": body.get("previous_response_id"),
        "usage": {
            "input_tokens": answer.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": n,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": answer.prompt_tokens + n,
        },
    }


def conversation_after(messages: list[dict], response: dict) -> list[dict]:
    """The chat messages through ``response``: what a later request's ``previous_response_id`` continues."""
    reply: dict[str, Any] = {"role": "assistant", "content": None}
    for item in response["output"]:
        if item["type"] == "message":
            reply["content"] = item["content"][0]["text"]
        else:
            call = {"name": item["name"], "arguments": item["arguments"]}
            reply.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": call})
    return [*messages, reply]


def events(response: dict) -> bytes:
    """A streamed response's server-sent events: created, each output item added (a message's text as one
    delta) and done, completed (or incomplete)."""
    seq = iter(range(1 << 30))
    out = [{"type": "response.created", "response": response | {"status": "in_progress", "output": []}}]
    for i, item in enumerate(response["output"]):
        out.append({"type": "response.output_item.added", "output_index": i, "item": item | {"status": "in_progress"}})
        if item["type"] == "message":
            part, where = item["content"][0], {"item_id": item["id"], "output_index": i, "content_index": 0}
            out.append({"type": "response.content_part.added", **where, "part": part | {"text": ""}})
            out.append({"type": "response.output_text.delta", **where, "delta": part["text"], "logprobs": []})
            out.append({"type": "response.output_text.done", **where, "text": part["text"], "logprobs": []})
            out.append({"type": "response.content_part.done", **where, "part": part})
        else:
            where = {"item_id": item["id"], "output_index": i}
            out.append({"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]})
        out.append({"type": "response.output_item.done", "output_index": i, "item": item})
    end = "response.completed" if response["status"] == "completed" else "response.incomplete"  # as OpenAI's
    out.append({"type": end, "response": response})
    return b"".join(
        f"event: {e['type']}\ndata: {json.dumps(e | {'sequence_number': next(seq)})}\n\n".encode() for e in out
    )
