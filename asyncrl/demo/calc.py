"""The tool-use demo task: integer arithmetic a tiny model can only get right by calling a calculator.

A record is ``{"prompt": "calc:37*58=", "answer": "2146"}``: two 2-digit operands and one of + - *.
The right episode is two model turns with the tool's result between them (plain byte encoding, no
chat template; ``</s>`` ends a model turn)::

    calc:37*58=  <call>calc 37*58</call></s>  2146;  2146</s>
    prompt       model turn 1 (mask 1)        tool   model turn 2 (mask 1)

The observation is the tool's result and ``;`` (the end of the observation, so the model knows where
its answer starts); a tool error reads ``error: ...;``, cut to ``OBS_CHARS``. The reward scores the
final turn's text only: 1.0 for exactly the answer, else 0.0 (no partial credit: the warm-up's
calling mode already succeeds often enough for GRPO, see ``asyncrl.demo.warmup``).

Environment latency (``episode.options`` ``latency_s`` / ``latency_sigma``, see
``asyncrl.demo.latency``) is the calculator's: each call waits its delay inside the tool, so
``episode.tool_timeout_s`` covers it and a heavy tail shows up as ``tool_timeout`` failures.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import TYPE_CHECKING

from asyncrl.demo import latency, sort
from asyncrl.episodes.tools import tool

if TYPE_CHECKING:
    from asyncrl.episodes.api import Context

PREFIX, SUFFIX = "calc:", "="
OPS = "+-*"
# Tuning: 2-digit operands (10-99) keep every prompt 11 tokens and every product 3-4 digits: far past
# what 2 layers compute in their head, and 3 x 90 x 90 = 24300 problems, of which 4000 train.
MIN_OPERAND, MAX_OPERAND = 10, 99
OBS_END = ";"
OBS_CHARS = 24  # an observation's cap: an error message never crowds the answer out of the budget
# The shipped data files: make_splits(N_TRAIN, N_EVAL, DATA_SEED) reproduces them exactly.
N_TRAIN = 4000
N_EVAL = 256
DATA_SEED = 4321

_ARITHMETIC = re.compile(r"[0-9+\-*() ]{1,64}")  # what may reach the parser at all
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


# ----------------------------------------------------------------------------------- the calculator


def evaluate(expression: str) -> int:
    """The value of integer arithmetic: decimal integers, + - * (binary and unary +/-) and
    parentheses, at most 64 characters. Anything else (names, calls, /, **, floats, 0x..., 1_000)
    raises ``ValueError``; nothing is ever executed, the expression's syntax tree is walked."""
    if not _ARITHMETIC.fullmatch(expression):
        raise ValueError("not arithmetic")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not arithmetic") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not arithmetic")


@tool
async def calc(expression: str) -> str:
    """Evaluate integer arithmetic exactly: + - * and parentheses, e.g. 37*58.

    Waits the current episode's latency first (none outside an episode)."""
    await latency.pause()
    return str(evaluate(expression))


# ----------------------------------------------------------------------------------- the task


def make_prompt(a: int, op: str, b: int) -> str:
    return f"{PREFIX}{a}{op}{b}{SUFFIX}"


def expression(prompt: str) -> str:
    """``calc:37*58=`` -> ``37*58``."""
    return prompt[len(PREFIX) : -len(SUFFIX)]


def make_record(rng: random.Random) -> dict:
    a, b = rng.randint(MIN_OPERAND, MAX_OPERAND), rng.randint(MIN_OPERAND, MAX_OPERAND)
    op = rng.choice(OPS)
    prompt = make_prompt(a, op, b)
    return {"prompt": prompt, "answer": str(evaluate(expression(prompt)))}


def make_splits(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Train and held-out records, all prompts distinct; eval is drawn first (see ``sort.make_splits``)."""
    return sort.distinct_splits(make_record, n_train, n_eval, seed)


def reward(prompt: str, completion: str, record: dict) -> float:
    """1.0 when the final turn's text is exactly the answer (surrounding whitespace aside), else 0.0."""
    del prompt  # the record holds the answer
    return 1.0 if completion.strip() == record["answer"] else 0.0


def observation(results: list[str]) -> str:
    """What the model reads after its calls: the results joined by ``;``, cut to ``OBS_CHARS``, ending ``;``."""
    return OBS_END.join(results)[: OBS_CHARS - len(OBS_END)] + OBS_END


def demonstration(record: dict, use_tool: bool) -> list[tuple[str, bool]]:
    """A warm-up episode as ``(text, is_model_turn)`` segments: the right one (call, result, answer),
    or the tool skipped: the first operand at once, a wrong answer the model learns exactly."""
    expr = expression(record["prompt"])
    if not use_tool:
        return [(record["prompt"], False), (re.split(r"[-+*]", expr, maxsplit=1)[0], True)]
    return [
        (record["prompt"], False),
        (f"<call>calc {expr}</call>", True),
        (observation([record["answer"]]), False),
        (record["answer"], True),
    ]


# ----------------------------------------------------------------------------------- the episode


async def episode(ctx: Context) -> dict[str, float]:
    """A model turn; if it calls tools, their results as one observation and one more turn (a single
    round: the episode's budget is sized for a call and an answer). The final turn is scored by
    ``data.reward``. The episode's latency is seeded by its seed (see ``asyncrl.demo.latency``)."""
    with latency.active(latency.Latency.from_options(ctx.options, ctx.seed)):
        turn = await ctx.generate()
        calls = ctx.tool_calls(turn.text)
        if calls:
            results = [await ctx.call_tool(call) for call in calls]
            ctx.observe(observation(results), role="tool")
            turn = await ctx.generate()
        return await ctx.score(turn.text)
