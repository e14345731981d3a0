"""Tools an episode's model may call: plain Python functions, declared with :func:`tool`.

A tool's JSON schema (for a system prompt, or a template's ``tools=``) comes from its type hints and
docstring; each tool has its own timeout. A tool-call parser turns a model turn's text into calls; it
is chosen by name (``simple``, ``hermes``) or by import path (a function ``text -> list[ToolCall]``):

* ``simple``: ``<call>NAME ARGUMENT</call>``: the text after the name is the tool's one string
  argument (short enough for a tiny model to learn: ``<call>calc 12*7</call>``);
* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format of the Hermes,
  Qwen and SmolLM3 chat templates.

Concurrency: an ``async`` tool runs on the generator's event loop; a plain one in a worker process of
the generator's pool, killed and replaced when it hangs past its timeout (see
``asyncrl.episodes.user_code``; a plain tool may run again when another call's fault killed its worker).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import typing
from collections.abc import Callable

from asyncrl.data import call_bounded, import_by_path
from asyncrl.errors import EpisodeFailure, UserError

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable
    description: str
    parameters: dict  # JSON schema of the arguments
    timeout_s: float | None  # None: the run's episode.tool_timeout_s

    @property
    def schema(self) -> dict:
        """The OpenAI-style function schema chat templates take as ``tools=``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def __call__(self, arguments: dict, timeout_s: float, call: Callable = call_bounded) -> str:
        """The tool's result as text; :class:`EpisodeFailure` ``tool_error`` / ``tool_timeout`` (and, run
        by the episode's ``call`` in a worker process, ``tool_crash`` / ``tool_memory``)."""
        try:
            result = await call(self.fn, timeout_s, **arguments)
        except TimeoutError:
            raise EpisodeFailure("tool_timeout", f"{self.name} gave no result within {timeout_s:g} s") from None
        except EpisodeFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - the tool's own error is the episode's data
            raise EpisodeFailure("tool_error", f"{self.name}: {type(exc).__name__}: {exc}") from exc
        return result if isinstance(result, str) else json.dumps(result)


def tool(fn: Callable | None = None, *, name: str | None = None, timeout_s: float | None = None):
    """Declare a tool: ``@tool`` or ``@tool(timeout_s=2)`` over a function with typed parameters."""

    def declare(f: Callable) -> Tool:
        hints = typing.get_type_hints(f)
        params = [p for p in inspect.signature(f).parameters.values() if p.name != "return"]
        doc = inspect.getdoc(f) or ""
        properties = {
            p.name: {"type": _JSON_TYPES.get(typing.get_origin(hints.get(p.name)) or hints.get(p.name), "string")}
            for p in params
        }
        required = [p.name for p in params if p.default is inspect.Parameter.empty]
        schema = {"type": "object", "properties": properties, "required": required}
        return Tool(name or f.__name__, f, doc.split("\n\n")[0], schema, timeout_s)

    return declare(fn) if fn is not None else declare


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


_SIMPLE = re.compile(r"<call>\s*(\S+)\s?(.*?)</call>", re.DOTALL)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_simple(text: str, tools: dict[str, Tool]) -> list[ToolCall]:
    calls = []
    for name, argument in _SIMPLE.findall(text):
        spec = tools.get(name)
        first = next(iter(spec.parameters["properties"]), None) if spec else None
        calls.append(ToolCall(name, {first: argument} if first else {}))
    return calls


def parse_hermes(text: str, tools: dict[str, Tool]) -> list[ToolCall]:
    calls = []
    for body in _HERMES.findall(text):
        try:
            obj = json.loads(body)
            calls.append(ToolCall(str(obj["name"]), dict(obj.get("arguments") or {})))
        except (ValueError, KeyError, TypeError):
            calls.append(ToolCall("", {"_unparsed": body}))  # the episode reports it back as an error
    return calls


PARSERS: dict[str, Callable[[str, dict[str, Tool]], list[ToolCall]]] = {"simple": parse_simple, "hermes": parse_hermes}


def load_parser(spec: str) -> Callable[[str, dict[str, Tool]], list[ToolCall]]:
    if spec in PARSERS:
        return PARSERS[spec]
    if ":" not in spec:
        raise UserError(f"unknown tool parser {spec!r}; known: {', '.join(sorted(PARSERS))}, or 'module:function'")
    return import_by_path(spec)


def load_tools(specs: list[str]) -> dict[str, Tool]:
    """The tools ``specs`` name (import paths of :func:`tool` objects), by tool name."""
    tools = {}
    for spec in specs:
        obj = import_by_path(spec)
        if not isinstance(obj, Tool):
            raise UserError(f"{spec!r} is not a tool: declare it with @asyncrl.episodes.tools.tool")
        if obj.name in tools:
            raise UserError(f"two tools are named {obj.name!r}")
        tools[obj.name] = obj
    return tools
