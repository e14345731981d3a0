"""One agent session's conversation as its episode's sample: OpenAI requests matched against the tokens
the sample holds, so only what is new is ever encoded (``asyncrl.gateway.server`` serves it).

A chat conversation is a list of **units**: the prompt (the messages before the first assistant
message), then assistant messages and observations (runs of user / tool / system messages between two
assistant messages) in turn. Each request's messages are cut into units and compared, unit by unit,
with what the sample holds:

* they **extend** it (the usual agent loop: everything sent so far, the last answer, then tool results
  or a user reply): only the new units are encoded. An observation is the chat-template difference of
  ``asyncrl.chat`` after the assistant turn it follows (a run of several messages of one role is
  joined with a newline into one message, as ``tool_episode`` joins tool results); a model turn's
  tokens are the engine's, never decoded and encoded again;
* they **rewrite** it (the agent edited, dropped or reordered earlier messages): the sample is
  **forked**: cut back to the last unit both agree on (its model tokens stay, sampled in the same
  context) and the request's other units appended as context. The cut-off branch is not trained: the
  episode is still ONE sample of its group, the last branch, scored as the episode ends; each fork is
  counted (``tools/agent_fork`` in the generator's metrics). An assistant message the sample holds no
  tokens for (written by the agent) is context too: mask 0, encoded the way the model emits a turn;
* a request that repeats the previous one exactly (a client's retry) gets the previous answer again.

The prompt unit must render to the task's prompt exactly as the run renders it (its ``prompt`` or
``messages``, and ``episode.system_prompt``): the group's samples share those ids.

A text completion session (``/completions``) does the same on text: each prompt must begin with the
text the session holds (the task's prompt, each answer as returned, what the agent added), else it forks
back to the longest earlier state it begins with.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import TYPE_CHECKING, Any

from asyncrl.data import prompt_of
from asyncrl.episodes.tools import Tool, ToolCall

if TYPE_CHECKING:
    from asyncrl.episodes.api import Context, ModelTurn

FORK = "agent_fork"  # the counter a fork adds to (ctx.tool_failures: the generator's tools/... metrics)
UNTRUSTED = "agent_untrusted_call"  # ... and a call left in the text: an undeclared tool or arguments not JSON
JOIN = "\n"  # between the messages of one observation (tool_episode joins tool results the same way)
# The markup of the built-in tool-call formats: cut from an answer's content once parsed into tool_calls,
# and how a tool call the agent wrote into an assistant message is written back for the model.
MARKUP = {
    "simple": re.compile(r"<call>.*?</call>", re.DOTALL),
    "hermes": re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL),
}


class BadRequest(Exception):
    """A request this session cannot serve: answered 400 with ``code``; the sample is as it was."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


@dataclasses.dataclass(frozen=True)
class Mark:
    """The record's extent after a unit: what a fork cuts back to."""

    tokens: int
    turns: int
    rewards: int
    finish_reason: str
    after: tuple[int, ...]  # the last assistant unit's ids (an observation's closing overlaps them)


def mark(ctx: Context, after: tuple[int, ...]) -> Mark:
    return Mark(len(ctx.tokens), ctx.turns, len(ctx.turn_rewards), ctx.finish_reason, after)


def cut(ctx: Context, m: Mark) -> None:
    """Cut ``ctx``'s record back to ``m``."""
    ctx.tokens, ctx.mask = ctx.tokens[: m.tokens], ctx.mask[: m.tokens]
    ctx.logprobs, ctx.versions = ctx.logprobs[: m.tokens], ctx.versions[: m.tokens]
    ctx.turns, ctx.turn_rewards, ctx.finish_reason = m.turns, ctx.turn_rewards[: m.rewards], m.finish_reason


def text_of(content: Any, param: str) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRequest("only text content is supported (a string, or a list of text parts)", "unsupported_content", param)


def canonical(message: Any, i: int) -> tuple:
    """A message as compared with the sample: role and content; an assistant's tool calls by name and
    arguments (their ids and the agent's formatting of the JSON do not matter)."""
    param = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant", "tool"):
        raise BadRequest("each message needs a role: system, developer, user, assistant or tool", param=param)
    role, content = message["role"], text_of(message.get("content"), f"{param}.content")
    if role != "assistant":
        return (role, content)
    calls = []
    for call in message.get("tool_calls") or ():
        try:
            fn = call["function"]
            args = fn.get("arguments") or "{}"
            parsed = json.loads(args) if isinstance(args, str) else args
            calls.append((str(fn["name"]), json.dumps(parsed, sort_keys=True)))
        except (TypeError, KeyError, ValueError):
            raise BadRequest("a tool call needs function.name and JSON function.arguments", param=param) from None
    return ("assistant", content.strip(), tuple(calls))


def units_of(messages: list[tuple]) -> list[tuple[tuple, ...]]:
    """The prompt unit, then each assistant message alone and each run of other messages together."""
    units: list[tuple[tuple, ...]] = []
    for m in messages:
        if m[0] != "assistant" and units and units[-1][-1][0] != "assistant":
            units[-1] = (*units[-1], m)
        else:
            units.append((m,))
    return units


def trusted(call: ToolCall, tools: dict[str, Tool]) -> bool:
    """A call to a function the request declared, with a JSON object of arguments."""
    return call.name in tools and isinstance(call.arguments, dict) and "_unparsed" not in call.arguments


def request_tools(specs: Any) -> dict[str, Tool]:
    """The request's ``tools`` as the parsers see them (name -> schema; nothing to run: the agent runs them)."""
    if specs is None:
        return {}
    if not isinstance(specs, list):
        raise BadRequest("'tools' must be a list of function tools", param="tools")
    tools = {}
    for spec in specs:
        fn = spec.get("function") if isinstance(spec, dict) and spec.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest("each tool must be {'type': 'function', 'function': {'name': ...}}", param="tools")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        tools[fn["name"]] = Tool(fn["name"], lambda: None, str(fn.get("description", "")), params, None)
    return tools


@dataclasses.dataclass
class Answer:
    """One model turn as the endpoint answers it."""

    turn: ModelTurn
    content: str | None
    calls: list[ToolCall]
    finish_reason: str  # "stop" | "length" | "tool_calls"
    prompt_tokens: int
    logprobs: list[float]
    call_ids: list[str] = dataclasses.field(default_factory=list)


class Conversation:
    """The sample of one agent episode, driven by OpenAI-shaped requests (one at a time)."""

    def __init__(self, ctx: Context, parser, parser_name: str):
        self.ctx, self.parser, self.parser_name = ctx, parser, parser_name
        self.chat_tokens = ctx.chat  # the generator's ChatTokens (the same renders as ctx.observe)
        self.units: list[tuple[tuple, ...]] = []
        self.marks: list[Mark] = []  # marks[i]: after units[: i + 1]
        self.sampled: dict[tuple, tuple[int, ...]] = {}  # an assistant message the model wrote -> its tokens
        self.last: tuple[Any, Any] | None = None  # (the last request's key, its answer): a retry gets it again
        self.last_text: str | None = None  # the last model turn's text (data.reward scores it)
        self.text: list[tuple[str, Mark]] = []  # a /completions session: (text so far, the record's mark)

    # -- chat ---------------------------------------------------------------------------------------------
    async def chat(self, messages: list, tools: dict[str, Tool], max_tokens: int | None, stop: list[str]) -> Answer:
        if self.text:
            raise BadRequest("this session speaks /completions; a session speaks one of the two", "mixed_session")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", param="messages")
        msgs = [canonical(m, i) for i, m in enumerate(messages)]
        if msgs[-1][0] == "assistant":
            raise BadRequest("the last message must be the user's or a tool's: the model answers it", param="messages")
        key = (tuple(msgs), tuple(tools), max_tokens, tuple(stop))
        if self.last is not None and self.last[0] == key:
            return self.last[1]
        units = units_of(msgs)
        if not self.units:
            self._open(units[0])
        elif units[0] != self.units[0]:
            raise BadRequest("the conversation's first messages differ from the session's prompt", "prompt_mismatch")
        same = next((i for i, (a, b) in enumerate(zip(units, self.units, strict=False)) if a != b), None)
        same = min(len(units), len(self.units)) if same is None else same
        for before, unit in zip(units[same - 1 :], units[same:], strict=False):
            self._check(before, unit)  # before anything changes: a refused request leaves the sample as it was
        if same < len(self.units):  # the history was rewritten: the sample forks back to what both agree on
            cut(self.ctx, self.marks[same - 1])
            del self.units[same:], self.marks[same:]
            self.ctx.tool_failures[FORK] += 1
        for unit in units[same:]:
            self._append(unit)
        answer = await self._turn(max_tokens, stop, tools)
        content = answer.content or ""
        message = (
            "assistant",
            content.strip(),
            tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in answer.calls),
        )
        self._push((message,), tuple(answer.turn.token_ids))
        self.sampled[message] = tuple(answer.turn.token_ids)
        self.last = (key, answer)
        return answer

    def _open(self, unit: tuple[tuple, ...]) -> None:
        """The prompt unit: it must be the task's prompt, as the run rendered it."""
        chat, ctx = self.chat_tokens, self.ctx
        if chat.templated:
            ids = chat.prompt_ids([{"role": m[0], "content": m[1]} for m in unit])
        else:
            ids = chat.prompt_ids(JOIN.join(m[1] for m in unit))
        if ids != ctx.prompt_ids:
            task = prompt_of(ctx.task)
            raise BadRequest(
                f"the conversation must open with the task's prompt as the run renders it ({task!r}, with "
                "episode.system_prompt if set): the group's samples share those tokens",
                "prompt_mismatch",
                "messages",
            )
        self.units, self.marks = [unit], [mark(ctx, ())]

    def _append(self, unit: tuple[tuple, ...]) -> None:
        """One unit the model did not write in this branch: an observation, or an assistant message (mask 0)."""
        ctx, chat, after = self.ctx, self.chat_tokens, self.marks[-1].after
        first = unit[0]
        if first[0] == "assistant":
            ids = self.sampled.get(first) or tuple(chat.response_ids(self._written(first)))
            ctx.observe(list(ids))
            self._push(unit, ids)
            return
        ctx.observe(chat.observation_ids(JOIN.join(m[1] for m in unit), first[0], after=list(after)))
        self._push(unit, after)

    def _check(self, before: tuple[tuple, ...], unit: tuple[tuple, ...]) -> None:
        """Refuse a unit this session cannot encode after ``before``."""
        if unit[0][0] == "assistant":
            if before[-1][0] == "assistant":
                raise BadRequest("two assistant messages in a row", param="messages")
            if unit[0] not in self.sampled:
                self._written(unit[0])  # raises for tool calls a custom parser's format cannot write back
            return
        roles = {m[0] for m in unit}
        if len(roles) > 1 and self.chat_tokens.templated:
            raise BadRequest(
                f"messages of different roles ({', '.join(sorted(roles))}) between two assistant messages",
                "unsupported_messages",
                "messages",
            )

    def _written(self, message: tuple) -> str:
        """An assistant message the agent wrote, as the model would have: content and tool calls in the
        run's format."""
        _, content, calls = message
        if not calls:
            return content
        if self.parser_name == "simple":
            written = [f"<call>{name} {next(iter(json.loads(a).values()), '')}</call>" for name, a in calls]
        elif self.parser_name == "hermes":
            written = [f'<tool_call>\n{{"name": {json.dumps(n)}, "arguments": {a}}}\n</tool_call>' for n, a in calls]
        else:
            raise BadRequest("an assistant message with tool calls the model did not write, under a custom parser")
        return "".join([content, *written])

    def _push(self, unit: tuple[tuple, ...], after: tuple[int, ...]) -> None:
        self.units.append(unit)
        self.marks.append(mark(self.ctx, after))

    async def _turn(self, max_tokens: int | None, stop: list[str], tools: dict[str, Tool]) -> Answer:
        ctx = self.ctx
        prompt_tokens = len(ctx.prompt_ids) + len(ctx.tokens)
        turn = await ctx.generate(max_tokens)
        self.last_text = turn.text
        text, reason = turn.text, turn.finish_reason
        cuts = [i for s in stop if (i := text.find(s)) >= 0]
        if cuts:  # the request's stop strings end the text (OpenAI leaves them out); the tokens stay as sampled
            text, reason = text[: min(cuts)], "stop"
        calls, content = self._calls(text, tools) if tools else ([], text)
        if calls:
            reason = "tool_calls"
        ids = [f"call_{secrets.token_hex(8)}" for _ in calls]
        lps = ctx.logprobs[len(ctx.logprobs) - len(turn.token_ids) :]
        return Answer(turn, content or None, calls, reason, prompt_tokens, lps, ids)

    def _calls(self, text: str, tools: dict[str, Tool]) -> tuple[list[ToolCall], str]:
        """The tool calls an agent framework can trust in ``text`` (to a function the request declared, with
        arguments that parsed as a JSON object: what the OpenAI API itself returns) and the content left: a
        built-in format's markup of those calls cut out, any other call's left as the text the model wrote, so
        the agent reads a plain answer (the sample's tokens are the same either way); each one left is counted."""
        markup = MARKUP.get(self.parser_name)
        if markup is None:  # a custom parser: its calls' markup is its own, so the content stays whole
            parsed = self.parser(text, tools)
            calls = [c for c in parsed if trusted(c, tools)]
            self.ctx.tool_failures[UNTRUSTED] += len(parsed) - len(calls)
            return calls, text
        calls, kept, at = [], [], 0
        for m in markup.finditer(text):
            parsed = self.parser(m.group(0), tools)
            if len(parsed) == 1 and trusted(parsed[0], tools):
                calls.append(parsed[0])
                kept.append(text[at : m.start()])
                at = m.end()
            else:
                self.ctx.tool_failures[UNTRUSTED] += 1
        content = "".join([*kept, text[at:]])
        return calls, content.strip() if calls else content

    # -- text completions ---------------------------------------------------------------------------------
    async def complete(self, prompt: Any, max_tokens: int | None, stop: list[str]) -> Answer:
        if self.units:
            raise BadRequest("this session speaks /chat/completions; a session speaks one of the two", "mixed_session")
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' must be one string", param="prompt")
        key = (prompt, max_tokens, tuple(stop))
        if self.last is not None and self.last[0] == key:
            return self.last[1]
        ctx, chat = self.ctx, self.chat_tokens
        if not self.text:
            task = prompt_of(ctx.task)
            opening = chat.tok.decode(ctx.prompt_ids) if chat.templated or not isinstance(task, str) else task
            if not prompt.startswith(opening):
                raise BadRequest(
                    "the prompt must begin with the task's prompt as the run renders it", "prompt_mismatch"
                )
            self.text = [(opening, mark(ctx, ()))]
        at = max((i for i, (t, _) in enumerate(self.text) if prompt.startswith(t)), default=None)
        if at is None:
            raise BadRequest("the prompt must begin with the task's prompt as the run renders it", "prompt_mismatch")
        if at < len(self.text) - 1:  # not an extension of the whole text so far: fork
            cut(ctx, self.text[at][1])
            del self.text[at + 1 :]
            ctx.tool_failures[FORK] += 1
        held = self.text[-1][0]
        if len(prompt) > len(held):
            ctx.observe(list(chat.tok.encode(prompt[len(held) :], add_special_tokens=False)))
            self.text.append((prompt, mark(ctx, ())))
        answer = await self._turn(max_tokens, stop, {})
        self.text.append((prompt + (answer.content or ""), mark(ctx, ())))
        self.last = (key, answer)
        return answer
