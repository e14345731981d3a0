"""The agentic demos: calc (tool use) and guess (multi-turn feedback), their data, rewards, tool, Env,
latency, their episodes through ``asyncrl.episodes.api`` with a scripted model, and the warm-up's format."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.config import EpisodeConfig, FunctionEpisodeConfig
from asyncrl.demo import calc, guess, latency, warmup
from asyncrl.errors import EpisodeFailure

ROOT = Path(__file__).resolve().parents[2]


def _load(task: str, name: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / "data" / task / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer():
    from asyncrl.demo.model import build_tokenizer

    return build_tokenizer(warmup.MAX_POSITIONS)


# --- data ----------------------------------------------------------------------------------------


def test_calc_data_is_reproducible_disjoint_and_right():
    train, held_out = _load("calc", "train.jsonl"), _load("calc", "eval.jsonl")
    assert (train, held_out) == calc.make_splits(calc.N_TRAIN, calc.N_EVAL, calc.DATA_SEED)
    assert calc.make_splits(calc.N_TRAIN, calc.N_EVAL, calc.DATA_SEED) == (train, held_out)  # twice: pure
    prompts = [r["prompt"] for r in train + held_out]
    assert len(set(prompts)) == len(prompts)  # distinct, so eval is held out
    for rec in train + held_out:
        assert set(rec) == {"prompt", "answer"}
        a, op, b = rec["prompt"][len(calc.PREFIX) : len(calc.PREFIX) + 2], rec["prompt"][7], rec["prompt"][8:10]
        assert rec["prompt"] == calc.make_prompt(int(a), op, int(b)) and len(rec["prompt"]) == 11
        want = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert rec["answer"] == str(want)


def test_guess_data_is_reproducible_and_eval_covers_every_secret_once():
    train, held_out = _load("guess", "train.jsonl"), _load("guess", "eval.jsonl")
    assert (train, held_out) == guess.make_splits(guess.N_TRAIN, guess.DATA_SEED)
    assert [r["secret"] for r in held_out] == list(range(guess.LOW, guess.HIGH + 1))
    assert all(r["prompt"] == guess.PROMPT and guess.LOW <= r["secret"] <= guess.HIGH for r in train)
    assert len({r["secret"] for r in train}) == guess.HIGH - guess.LOW + 1


# --- rewards -------------------------------------------------------------------------------------

CALC = {"prompt": "calc:37*58=", "answer": "2146"}


def test_calc_reward_is_exact_match_of_the_final_turn():
    assert calc.reward(CALC["prompt"], "2146", CALC) == 1.0
    assert calc.reward(CALC["prompt"], " 2146\n", CALC) == 1.0
    for wrong in ["", "214", "21460", "2146;", "37", "<call>calc 37*58</call>", "-2146"]:
        assert calc.reward(CALC["prompt"], wrong, CALC) == 0.0


@given(st.integers(0, 10_000), st.text(alphabet="0123456789-;<> ", max_size=8))
def test_calc_reward_is_binary_and_one_only_for_the_answer(seed, text):
    rec = calc.make_record(random.Random(seed))
    for completion in (text, rec["answer"] + text, text + rec["answer"]):
        r = calc.reward(rec["prompt"], completion, rec)
        assert r in (0.0, 1.0)
        assert (r == 1.0) == (completion.strip() == rec["answer"])


@given(st.integers(guess.LOW, guess.HIGH), st.text(alphabet="0123456789 x-", max_size=4))
def test_guess_reward_is_one_only_for_the_secret(secret, text):
    rec = {"prompt": guess.PROMPT, "secret": secret}
    assert guess.reward(rec["prompt"], str(secret), rec) == 1.0
    r = guess.reward(rec["prompt"], text, rec)
    assert r == (1.0 if guess.parse_guess(text) == secret else 0.0)


# --- the calculator ------------------------------------------------------------------------------


@given(st.integers(-999, 999), st.sampled_from("+-*"), st.integers(-999, 999), st.integers(0, 99))
def test_calc_evaluates_integer_arithmetic(a, op, b, c):
    import operator

    fn = {"+": operator.add, "-": operator.sub, "*": operator.mul}[op]
    assert calc.evaluate(f"{a}{op}{b}") == fn(a, b)
    assert calc.evaluate(f"({a}) {op} ({b}) * {c}") == fn(a, b * c)


@pytest.mark.parametrize(
    "expression",
    ["", "2**10", "1/2", "7//2", "7%2", "1.5+1", "0x10", "1_000", "07", "1e3", "abs(-1)", "__import__('os')",
     "x+1", "1+", "()", "1 2", "(1", "[1]", "1;2", "9" * 65],
)  # fmt: skip
def test_calc_refuses_anything_but_integer_arithmetic(expression):
    with pytest.raises(ValueError, match="not arithmetic"):
        calc.evaluate(expression)


def test_calc_tool_answers_text_and_reports_refusals_as_tool_errors():
    assert calc.calc.name == "calc" and calc.calc.parameters["required"] == ["expression"]
    assert asyncio.run(calc.calc({"expression": "37*58"}, 1.0)) == "2146"
    with pytest.raises(EpisodeFailure) as err:
        asyncio.run(calc.calc({"expression": "open('x')"}, 1.0))
    assert err.value.cause == "tool_error" and "not arithmetic" in err.value.detail


def test_calc_observation_ends_with_the_marker_and_is_capped():
    assert calc.observation(["2146"]) == "2146;"
    assert calc.observation(["1", "2"]) == "1;2;"
    long = calc.observation(["error: calc: ValueError: not arithmetic"])
    assert len(long) == calc.OBS_CHARS and long.endswith(calc.OBS_END)


# --- the guess Env -------------------------------------------------------------------------------


def test_guess_env_replies_higher_lower_invalid_and_ends_on_the_secret():
    async def game():
        env = guess.Env()
        assert await env.reset({"prompt": guess.PROMPT, "secret": 11}, seed=3) is None
        steps = [await env.step(a) for a in ["8", "12", " 10 ", "ten", "", "11"]]
        await env.close()
        return steps

    steps = asyncio.run(game())
    assert [(o, r, d) for o, r, d, _ in steps] == [
        (guess.HIGHER, 0.0, False),
        (guess.LOWER, 0.0, False),
        (guess.HIGHER, 0.0, False),
        (guess.INVALID, 0.0, False),
        (guess.INVALID, 0.0, False),
        (guess.CORRECT, 1.0, True),
    ]


def test_guess_env_refuses_a_step_before_reset_and_bad_latency():
    with pytest.raises(RuntimeError):
        asyncio.run(guess.Env().step("3"))
    with pytest.raises(ValueError):
        guess.Env(latency_s=-1.0)


def test_guess_strategies_win_as_documented():
    def wins(strategy) -> int:
        n = 0
        for secret in range(guess.LOW, guess.HIGH + 1):
            segments = guess.demonstration({"prompt": guess.PROMPT, "secret": secret}, strategy, warmup.GUESS_TURNS)
            n += segments[-1][1] and guess.parse_guess(segments[-1][0]) == secret
        return n

    assert wins(guess.bisect) == 15 and wins(guess.lowest) == 4


# --- latency -------------------------------------------------------------------------------------


def _delays(lat: latency.Latency, n: int) -> list[float]:
    return [lat.next_delay() for _ in range(n)]


def test_latency_is_off_fixed_or_reproducible_per_seed():
    assert _delays(latency.Latency(), 3) == [0.0, 0.0, 0.0]
    assert _delays(latency.Latency(0.25, 0.0, seed=1), 3) == [0.25, 0.25, 0.25]
    a, b = _delays(latency.Latency(0.1, 1.0, seed=7), 50), _delays(latency.Latency(0.1, 1.0, seed=7), 50)
    assert a == b and len(set(a)) == 50
    assert a != _delays(latency.Latency(0.1, 1.0, seed=8), 50)
    opts = {"latency_s": 0.1, "latency_sigma": 1.0}
    assert _delays(latency.Latency.from_options(opts, 7), 50) == a
    for bad in ({"latency_s": -1}, {"latency_sigma": -0.5}, {"latency_s": math.inf}):
        with pytest.raises(ValueError):
            latency.Latency.from_options(bad, 0)


def test_latency_with_sigma_is_log_normal_around_the_median():
    delays = _delays(latency.Latency(0.2, 0.8, seed=0), 20_000)
    logs = [math.log(d) for d in delays]
    assert statistics.median(delays) == pytest.approx(0.2, rel=0.05)
    assert statistics.fmean(logs) == pytest.approx(math.log(0.2), abs=0.03)
    assert statistics.stdev(logs) == pytest.approx(0.8, rel=0.03)
    assert statistics.fmean(delays) == pytest.approx(0.2 * math.exp(0.8**2 / 2), rel=0.05)  # the heavy tail
    assert max(delays) > 10 * 0.2


@pytest.fixture
def slept(monkeypatch) -> list[float]:
    """Every asyncio.sleep of the latency module, recorded and skipped (no test waits real time)."""
    calls: list[float] = []

    async def fake_sleep(delay: float) -> None:
        calls.append(delay)

    monkeypatch.setattr(latency.asyncio, "sleep", fake_sleep)
    return calls


def test_tool_and_env_wait_their_episodes_delays(slept):
    opts = {"latency_s": 0.05, "latency_sigma": 0.5}

    async def tool_calls(seed: int) -> None:
        with latency.active(latency.Latency.from_options(opts, seed)):
            for _ in range(3):
                await calc.calc({"expression": "1+1"}, 5.0)

    async def env_steps(seed: int) -> None:
        env = guess.Env(**opts)
        await env.reset({"prompt": guess.PROMPT, "secret": 5}, seed)
        for _ in range(3):
            await env.step("1")

    asyncio.run(tool_calls(4))
    asyncio.run(env_steps(4))
    assert slept == _delays(latency.Latency(0.05, 0.5, seed=4), 3) * 2
    slept.clear()
    assert asyncio.run(latency.pause()) == 0.0 and slept == []  # outside an episode: no wait


# --- episodes through asyncrl.episodes.api, with a scripted model ------------------------------------------


def _context(tokenizer, record: dict, turns: list[str], cfg: EpisodeConfig, seen: list[list[int]]):
    """A Context whose model answers ``turns`` in order (each + </s>), recording the ids it was given."""
    from asyncrl.chat import ChatTokens, Completion
    from asyncrl.episodes import load_episode
    from asyncrl.episodes.api import Context
    from asyncrl.rewards.resolve import load_reward

    script = iter(turns)

    async def complete(ids: list[int], limit: int) -> Completion:
        seen.append(list(ids))
        tokens = tokenizer.encode(next(script)) + [tokenizer.eos_token_id]
        return Completion(tokens, [-0.5] * len(tokens), "stop", [3] * len(tokens))

    episode, tools, parser = load_episode(cfg)
    chat = ChatTokens(tokenizer)
    ctx = Context(
        task=record,
        seed=11,
        prompt_ids=chat.prompt_ids(record["prompt"]),
        complete=complete,
        chat=chat,
        budget=cfg.max_tokens,
        max_new_tokens=28,
        cfg=cfg,
        tools=tools,
        parser=parser,
        reward=load_reward(cfg.function.split(":")[0] + ":reward", 5.0),  # the task module's reward
    )
    return episode, ctx


def _run(tokenizer, record: dict, turns: list[str], cfg: EpisodeConfig):
    from asyncrl.episodes.api import run_episode

    seen: list[list[int]] = []
    episode, ctx = _context(tokenizer, record, turns, cfg, seen)
    outcome = asyncio.run(run_episode(episode, ctx, 30.0))
    return ctx, outcome, seen


def _expected(tokenizer, segments: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Response tokens and mask of ``segments`` after the prompt: model turns + </s> (1), observations (0)."""
    tokens, mask = [], []
    for text, is_model in segments[1:]:
        ids = tokenizer.encode(text) + ([tokenizer.eos_token_id] if is_model else [])
        tokens += ids
        mask += [int(is_model)] * len(ids)
    return tokens, mask


CALC_CFG = FunctionEpisodeConfig(
    function="asyncrl.demo.calc:episode", tools=["asyncrl.demo.calc:calc"], max_turns=2, max_tokens=80
)


def test_calc_episode_right_and_wrong(tokenizer):
    ctx, outcome, seen = _run(tokenizer, CALC, ["<call>calc 37*58</call>", "2146"], CALC_CFG)
    tokens, mask = _expected(tokenizer, calc.demonstration(CALC, use_tool=True))
    assert outcome.status == "ok" and outcome.parts == {"reward": 1.0}
    assert ctx.tokens == tokens and ctx.mask == mask and ctx.turns == 2
    assert tokenizer.decode(ctx.tokens[mask.index(0) : len(mask) - mask[::-1].index(0)]) == "2146;"
    assert [v for v, m in zip(ctx.versions, mask, strict=True) if not m] == [-1] * 5
    assert [lp for lp, m in zip(ctx.logprobs, mask, strict=True) if not m] == [0.0] * 5
    answer = tokenizer.encode("2146") + [tokenizer.eos_token_id]
    assert seen[1] == ctx.prompt_ids + tokens[: -len(answer)] and tokens[-len(answer) :] == answer

    ctx, outcome, _ = _run(tokenizer, CALC, ["37"], CALC_CFG)  # skips the tool: one turn, wrong
    assert outcome.parts == {"reward": 0.0} and ctx.turns == 1
    assert ctx.tokens == tokenizer.encode("37") + [tokenizer.eos_token_id] and set(ctx.mask) == {1}

    ctx, outcome, _ = _run(tokenizer, CALC, ["<call>calc 37*58</call>", "2147"], CALC_CFG)  # misreads it
    assert outcome.parts == {"reward": 0.0} and ctx.turns == 2


def test_calc_episode_observes_a_refused_call_as_a_short_error(tokenizer):
    ctx, outcome, _ = _run(tokenizer, CALC, ["<call>calc 37/58</call>", "0"], CALC_CFG)
    assert outcome.parts == {"reward": 0.0} and ctx.tool_failures == {"tool_error": 1}
    observed = tokenizer.decode([t for t, m in zip(ctx.tokens, ctx.mask, strict=True) if not m])
    assert observed.startswith("error: calc: ValueError") and len(observed) == calc.OBS_CHARS


GUESS_CFG = FunctionEpisodeConfig(function="asyncrl.demo.guess:Env", max_turns=4, max_tokens=64)
SECRET = {"prompt": guess.PROMPT, "secret": 11}


def test_guess_episode_right_and_wrong(tokenizer):
    ctx, outcome, seen = _run(tokenizer, SECRET, ["8", "12", "10", "11"], GUESS_CFG)
    tokens, mask = _expected(tokenizer, guess.demonstration(SECRET, guess.bisect, turns=4))
    assert outcome.parts == {"reward": 1.0} and ctx.turns == 4
    assert ctx.tokens == tokens and ctx.mask == mask
    assert tokenizer.decode(seen[1][len(ctx.prompt_ids) :]) == "8</s>higher;"
    assert [v for v, m in zip(ctx.versions, mask, strict=True) if not m] == [-1] * mask.count(0)

    ctx, outcome, _ = _run(tokenizer, SECRET, ["1", "2", "3", "4"], GUESS_CFG)  # the scan: out of turns
    assert outcome.parts == {"reward": 0.0} and ctx.turns == 4
    assert tokenizer.decode(ctx.tokens) == "1</s>higher;2</s>higher;3</s>higher;4</s>higher;"

    ctx, outcome, _ = _run(tokenizer, SECRET, ["11"], GUESS_CFG)  # found at once
    assert outcome.parts == {"reward": 1.0} and ctx.turns == 1 and set(ctx.mask) == {1}


def test_guess_env_options_come_from_the_config(tokenizer, slept):
    cfg = FunctionEpisodeConfig(
        function="asyncrl.demo.guess:Env", max_turns=4, max_tokens=64, options={"latency_s": 0.01, "latency_sigma": 0}
    )
    _, outcome, _ = _run(tokenizer, SECRET, ["1", "2", "3", "4"], cfg)
    assert outcome.status == "ok" and slept == [0.01] * 4  # one wait per step


# --- the warm-up ---------------------------------------------------------------------------------


def test_demonstrations_are_what_the_episodes_produce(tokenizer):
    """The SFT rows are token for token the episodes the generator plays, loss only on model turns."""
    cases = [(CALC, calc.demonstration(CALC, use_tool), CALC_CFG) for use_tool in (True, False)]
    for secret in (1, 5, 16):
        rec = {"prompt": guess.PROMPT, "secret": secret}
        cases += [(rec, guess.demonstration(rec, s, turns=4), GUESS_CFG) for s in (guess.bisect, guess.lowest)]
    for record, segments, cfg in cases:
        ids, labels = warmup.encode_demonstration(tokenizer, segments)
        ctx, _, _ = _run(tokenizer, record, [text for text, is_model in segments if is_model], cfg)
        assert ids == ctx.prompt_ids + ctx.tokens
        assert [lb != -100 for lb in labels] == [False] * len(ctx.prompt_ids) + [bool(m) for m in ctx.mask]
        assert all(lb in (-100, i) for lb, i in zip(labels, ids, strict=True))


def test_lockstep_play_is_deterministic_on_an_untrained_model(tokenizer):
    import torch

    from asyncrl.demo.model import build_model

    torch.set_num_threads(1)
    model = build_model(tokenizer, seed=0, max_positions=warmup.MAX_POSITIONS)
    recipe = warmup.RECIPES["demo-guess"]
    records = guess.make_splits(0, 0)[1][:4]
    runs = [warmup.play(model, tokenizer, recipe, records, temperature=1.0, seed=5) for _ in range(2)]
    assert len(runs[0]) == 4 and all(o.status == "ok" for _, o in runs[0])
    assert [(c.tokens, c.mask, c.logprobs, o.parts) for c, o in runs[0]] == [
        (c.tokens, c.mask, c.logprobs, o.parts) for c, o in runs[1]
    ]
    assert 0.0 <= warmup.success_rate(runs[0]) <= 1.0


def test_a_cached_model_of_another_recipe_is_refused(tmp_path):
    from asyncrl.demo.model import RECIPE_FILE
    from asyncrl.demo.recipes import prepare_demo_model

    (tmp_path / RECIPE_FILE).write_text(json.dumps({"recipe": "demo-sort"}))
    with pytest.raises(FileExistsError, match="demo-sort"):
        prepare_demo_model(tmp_path, recipe="demo-guess", log=lambda _: None)


@pytest.mark.slow
def test_demo_guess_recipe_warms_up_a_weak_but_explorable_policy(tmp_path):
    import torch
    from transformers import AutoConfig

    from asyncrl.demo.model import RECIPE_FILE
    from asyncrl.demo.recipes import prepare_demo_model

    torch.set_num_threads(2)
    path = prepare_demo_model(tmp_path / "guess", seed=0, log=lambda _: None, recipe="demo-guess")
    recipe = json.loads((path / RECIPE_FILE).read_text())
    assert recipe["recipe"] == "demo-guess" and AutoConfig.from_pretrained(path).max_position_embeddings == 128
    assert recipe["eval_reward"] <= 0.4 and recipe["sample_reward"] >= 0.2
