"""The README's episode example runs as written: its Env and its tool episode, through the episode API
with a scripted model."""

from __future__ import annotations

import asyncio
import importlib
import re
import sys

from demo_launch import ROOT
from test_episodes import TOK, make_ctx, scripted

from asyncrl.config import FunctionEpisodeConfig
from asyncrl.episodes import load_episode
from asyncrl.episodes.api import run_episode


def readme_example(tmp_path):
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- episode-example -->\n```python\n(.*?)```", text, re.DOTALL).group(1)
    assert len(block.splitlines()) < 40
    (tmp_path / "my_task.py").write_text(block)
    sys.path.insert(0, str(tmp_path))
    sys.modules.pop("my_task", None)
    return importlib.import_module("my_task")


def test_the_readme_guess_env_plays_to_its_reward(tmp_path):
    readme_example(tmp_path)
    cfg = FunctionEpisodeConfig(function="my_task:Guess", options={"latency_s": 0.01}, max_turns=5)
    episode = load_episode(cfg)[0]
    ctx = make_ctx(scripted("8", "12", "10", "11"), **{"max_turns": 5})
    ctx.task = {"prompt": "guess:", "secret": 11}
    out = asyncio.run(run_episode(episode, ctx, 60))
    assert out.status == "ok" and out.parts == {"reward": 1.0} and ctx.turns == 4
    observed = TOK.decode([t for t, m in zip(ctx.tokens, ctx.mask, strict=True) if m == 0])
    assert observed == "higherlowerhigher"


def test_the_readme_tool_episode_calls_calc_and_scores_the_answer(tmp_path):
    mod = readme_example(tmp_path)
    assert mod.calc.schema["function"]["parameters"]["properties"] == {"expression": {"type": "string"}}
    ctx = make_ctx(scripted("<call>calc 12*34</call>", "408"), reward=lambda p, c, r: float(c == "408"),
                   tools=["my_task:calc"])  # fmt: skip
    out = asyncio.run(run_episode(mod.solve, ctx, 60))
    assert out.status == "ok" and out.parts == {"reward": 1.0, "turns": -0.02}
    assert TOK.decode([t for t, m in zip(ctx.tokens, ctx.mask, strict=True) if m == 0]) == "408"
