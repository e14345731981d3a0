"""The calc task as an OpenAI Agents SDK agent written with the SDK's defaults (its Responses model, a
``@function_tool``, ``Runner.run``), as a user writes one: the run's client reaches the SDK through its
provider, nothing else changes. Imports nothing from asyncrl but the demo's arithmetic."""

from __future__ import annotations

from agents import Agent, RunConfig, Runner, function_tool, set_tracing_disabled
from agents.models.openai_provider import OpenAIProvider

from asyncrl.demo.calc_agent import calculate

set_tracing_disabled(True)  # offline: the SDK would send its traces to OpenAI


@function_tool
def calc(expression: str) -> str:
    """Evaluate integer arithmetic exactly: + - * and parentheses, e.g. 37*58."""
    return calculate(expression) + ";"  # the observation the demo's model was warmed up on


AGENT = Agent(name="calc", tools=[calc], model="policy")


async def play(client, task: dict) -> None:
    result = await Runner.run(AGENT, task["prompt"], run_config=RunConfig(model_provider=OpenAIProvider(
        openai_client=client)), max_turns=3)  # fmt: skip
    task["said"] = result.final_output  # the run's data.reward scores the last model turn
