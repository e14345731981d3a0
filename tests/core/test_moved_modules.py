"""Configs and user code written against the flat asyncrl/ of before the house issue (24) keep working: an
old module path imports the module at its new one, with a FutureWarning that names the new path."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import warnings

import pytest
from demo_launch import DEMO, ROOT

import asyncrl
from asyncrl.config import load_config
from asyncrl.rewards.resolve import load_reward, score


@pytest.mark.parametrize(("old", "new"), sorted(asyncrl.MOVED_MODULES.items()))
def test_every_old_path_imports_its_new_module(old, new):
    code = textwrap.dedent(f"""
        import importlib, warnings
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            old = importlib.import_module({old!r})
        assert old is importlib.import_module({new!r}), (old, {new!r})
        assert any({new!r} in str(w.message) and w.category is FutureWarning for w in seen), seen
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_config_naming_the_old_math_reward_scores_through_it():
    cfg = load_config(DEMO, {"data.reward": "asyncrl.math_reward:math_reward"})
    with pytest.warns(FutureWarning, match="asyncrl.rewards.math_answer"):
        fn = load_reward(cfg.data.reward, timeout_s=30)
    parts = asyncio.run(score(fn, "What is 1/2?", "The answer is \\boxed{0.5}", {"answer": "1/2"}, 30))
    assert parts == {"reward": 1.0}


def test_user_code_importing_the_old_tools_module_declares_a_tool():
    code = textwrap.dedent("""
        import warnings
        warnings.simplefilter("error", FutureWarning)
        try:
            from asyncrl.tools import tool
        except FutureWarning as w:
            print(w)
        warnings.simplefilter("ignore", FutureWarning)
        from asyncrl.tools import tool
        from asyncrl.episodes.tools import Tool

        @tool
        def add(a: int, b: int) -> int:
            "Add two numbers."
            return a + b

        assert isinstance(add, Tool) and add.name == "add"
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "asyncrl.tools is now asyncrl.episodes.tools: update the import path"


def test_the_old_rewards_module_names_still_resolve():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        from asyncrl.rewards import load_reward as old

    assert old is load_reward
    assert {str(w.message) for w in seen} == {"asyncrl.rewards.load_reward is now asyncrl.rewards.resolve.load_reward"}
    with pytest.raises(ImportError, match="cannot import name 'no_such_name'"):
        from asyncrl.rewards import no_such_name  # noqa: F401
