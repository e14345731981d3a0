"""The episode API against a scripted model: tokens, masks and versions of each turn, tools, rewards,
and every failure an episode can end in, with its cause."""

from __future__ import annotations

import asyncio
import math

import episode_fixtures as fx
import pytest

from asyncrl.chat import ChatTokens, Completion
from asyncrl.config import CompletionEpisodeConfig, FunctionEpisodeConfig
from asyncrl.demo.model import build_tokenizer
from asyncrl.episodes import load_episode
from asyncrl.episodes.api import Context, env_episode, run_episode, single_turn, tool_episode
from asyncrl.episodes.tools import load_parser, load_tools
from asyncrl.errors import EpisodeFailure, UserError
from asyncrl.rewards.resolve import reward_parts

TOK = build_tokenizer()
EOS = TOK.eos_token_id


def scripted(*texts: str, version: int = 7, engine_s: float = 0.0):
    """A ``complete`` that answers each turn with the next text (+ EOS), log-prob -0.5 per token."""
    answers = iter(texts)
    seen: list[list[int]] = []

    async def complete(ids: list[int], max_new: int) -> Completion:
        seen.append(list(ids))
        if engine_s:
            await asyncio.sleep(engine_s)
        tokens = (TOK.encode(next(answers)) + [EOS])[:max_new]
        reason = "stop" if tokens[-1] == EOS else "length"
        return Completion(tokens, [-0.5] * len(tokens), reason, [version] * len(tokens))

    complete.seen = seen
    return complete


def make_ctx(complete, *, reward=fx.reward_len, budget: int = 200, tools=(), stop=(), **cfg) -> Context:
    ep = CompletionEpisodeConfig(tools=list(tools), **cfg)
    return Context(
        task={"prompt": "q:", "answer": "x"},
        seed=3,
        prompt_ids=TOK.encode("q:"),
        complete=complete,
        chat=ChatTokens(TOK),
        stop=stop,
        budget=budget,
        max_new_tokens=64,
        cfg=ep,
        tools=load_tools(ep.tools),
        parser=load_parser(ep.tool_parser),
        reward=reward,
    )


def play(episode, ctx, timeout_s: float = 60.0):
    return asyncio.run(run_episode(episode, ctx, timeout_s))


def test_single_turn_keeps_the_engines_tokens_and_scores_the_text():
    ctx = make_ctx(scripted("abc"))
    out = play(single_turn, ctx)
    assert out.status == "ok" and out.parts == {"reward": 0.75}  # len("abc") / 4
    assert ctx.tokens == TOK.encode("abc") + [EOS] and ctx.mask == [1] * 4
    assert ctx.versions == [7] * 4 and ctx.logprobs == [-0.5] * 4 and ctx.turns == 1


def test_an_env_episode_interleaves_model_and_observation_tokens():
    complete = scripted("ab", "abcd")
    ctx = make_ctx(complete)
    out = play(env_episode(fx.CountingEnv, max_turns=5), ctx)
    assert out.status == "ok" and out.parts == {"reward": 2.0} and ctx.turns == 2
    first, obs, second = TOK.encode("go:"), TOK.encode("<2>"), TOK.encode("abcd") + [EOS]
    turn1 = TOK.encode("ab") + [EOS]
    assert ctx.tokens == first + turn1 + obs + second
    assert ctx.mask == [0] * 3 + [1] * 3 + [0] * 3 + [1] * 5
    assert ctx.versions == [-1] * 3 + [7] * 3 + [-1] * 3 + [7] * 5
    assert ctx.logprobs[:3] == [0.0] * 3
    # each turn is generated from everything before it, token for token
    assert complete.seen == [TOK.encode("q:") + first, TOK.encode("q:") + first + turn1 + obs]


def test_a_plain_env_runs_off_the_event_loop():
    ctx = make_ctx(scripted("a", "b"))
    out = play(env_episode(fx.PlainSlowEnv, max_turns=5), ctx)
    assert out.status == "ok" and out.parts == {"reward": 1.0} and len(ctx.env_seconds) >= 3


@pytest.mark.parametrize(
    ("env", "cause"), [(lambda: fx.RaisingEnv(every=1), "env_error"), (fx.HangingEnv, "env_timeout")]
)
def test_environment_failures_have_their_cause(env, cause):
    ctx = make_ctx(scripted("a", "b"), step_timeout_s=0.2)
    out = play(env_episode(env, max_turns=3), ctx)
    assert out.status == cause and out.parts is None and out.traceback


def test_the_episode_timeout_counts_the_episodes_own_time_not_the_engines():
    """Turns that wait 0.3 s each for the engine never trip a 0.2 s episode timeout; an environment
    that hangs does."""
    ctx = make_ctx(scripted("a", "b", "c", engine_s=0.3))
    assert play(env_episode(lambda: fx.CountingEnv(turns=3), max_turns=3), ctx, timeout_s=0.2).status == "ok"
    ctx = make_ctx(scripted("a", "b"), step_timeout_s=60)
    assert play(env_episode(fx.HangingEnv, max_turns=3), ctx, timeout_s=0.2).status == "episode_timeout"


def test_overrunning_the_token_budget_fails_as_budget():
    ctx = make_ctx(scripted(*["abcdef"] * 10), budget=20)
    out = play(fx.runaway, ctx)
    assert out.status == "budget" and len(ctx.tokens) <= 20


def test_the_episodes_own_bug_is_episode_error():
    async def buggy(ctx):
        await ctx.generate()
        return 1 / 0

    assert play(buggy, make_ctx(scripted("a"))).status == "episode_error"


@pytest.mark.parametrize(
    ("reward", "cause"),
    [
        (fx.reward_always_raises, "reward_error"),
        (fx.reward_string, "reward_invalid"),
        (fx.reward_nan, "reward_invalid"),
        (fx.reward_hangs, "reward_timeout"),
        (fx.reward_sleeps, "reward_timeout"),
    ],
)
def test_a_reward_that_fails_is_a_cause_never_a_zero(reward, cause):
    out = play(single_turn, make_ctx(scripted("a"), reward=reward, reward_timeout_s=0.3))
    assert out.status == cause and out.parts is None


def test_reward_parts():
    assert reward_parts(1) == {"reward": 1.0}
    assert reward_parts({"format": 0.5, "answer": 1}) == {"format": 0.5, "answer": 1.0}
    for bad in (True, None, "1", math.inf, {"a": math.nan}, {}):
        with pytest.raises(EpisodeFailure) as info:
            reward_parts(bad)
        assert info.value.cause == "reward_invalid"


def test_the_tool_loop_calls_tools_and_observes_their_results():
    complete = scripted("<call>upper hi</call>", "HI")
    ctx = make_ctx(complete, reward=fx.reward_len, tools=["episode_fixtures:upper"])
    out = play(tool_episode(max_turns=3), ctx)
    assert out.status == "ok" and ctx.turns == 2
    turn1 = TOK.encode("<call>upper hi</call>") + [EOS]
    assert ctx.tokens[: len(turn1)] == turn1
    assert ctx.tokens[len(turn1) : len(turn1) + 2] == TOK.encode("HI")  # the tool's result, mask 0
    assert ctx.mask[len(turn1) : len(turn1) + 2] == [0, 0]


@pytest.mark.parametrize(
    ("name", "cause"), [("broken", "tool_error"), ("stuck", "tool_timeout"), ("nope", "tool_error")]
)
def test_tool_failures_are_observed_or_fail_the_episode(name, cause):
    tools = ["episode_fixtures:broken", "episode_fixtures:stuck"]
    ctx = make_ctx(scripted(f"<call>{name} x</call>", "done"), tools=tools)
    out = play(tool_episode(max_turns=3), ctx)
    assert out.status == "ok" and ctx.tool_failures == {cause: 1}
    assert TOK.decode([t for t, m in zip(ctx.tokens, ctx.mask, strict=True) if m == 0]).startswith("error: ")
    ctx = make_ctx(scripted(f"<call>{name} x</call>", "done"), tools=tools, tool_errors="fail")
    assert play(tool_episode(max_turns=3), ctx).status == cause


def test_tool_schema_comes_from_hints_and_docstring():
    spec = fx.upper.schema["function"]
    assert spec["name"] == "upper" and spec["description"] == "The text in capitals."
    assert spec["parameters"] == {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def test_hermes_calls_parse_json_arguments():
    parse = load_parser("hermes")
    text = 'x <tool_call>{"name": "upper", "arguments": {"text": "a b"}}</tool_call> <tool_call>oops</tool_call>'
    calls = parse(text, {})
    assert calls[0].name == "upper" and calls[0].arguments == {"text": "a b"}
    assert calls[1].name == ""  # unparsable: answered as an unknown tool, counted as tool_error


def test_load_episode_picks_env_classes_functions_and_the_defaults():
    assert load_episode(CompletionEpisodeConfig())[0] is single_turn
    episode, tools, _ = load_episode(CompletionEpisodeConfig(tools=["episode_fixtures:upper"]))
    assert set(tools) == {"upper"} and episode is not single_turn
    assert load_episode(FunctionEpisodeConfig(function="episode_fixtures:runaway"))[0] is fx.runaway
    env_ep = load_episode(FunctionEpisodeConfig(function="episode_fixtures:CountingEnv", options={"turns": 1}))[0]
    ctx = make_ctx(scripted("a"))
    assert play(env_ep, ctx).parts == {"reward": 1.0} and ctx.turns == 1  # options reached the Env
    with pytest.raises(UserError, match="async def"):
        load_episode(FunctionEpisodeConfig(function="episode_fixtures:reward_len"))
    with pytest.raises(UserError, match="not a tool"):
        load_episode(CompletionEpisodeConfig(tools=["episode_fixtures:reward_len"]))


def test_every_episode_type_the_config_takes_has_one_builder():
    """A kind is a config member and a registry entry: one without the other is a type no run could play."""
    from asyncrl.config.episode import MEMBERS
    from asyncrl.episodes.kinds import KINDS

    assert set(KINDS) == set(MEMBERS)


def test_env_options_that_do_not_fit_its_constructor_fail_at_load_in_one_line():
    with pytest.raises(UserError, match=r"episode.options \['turn'\] do not fit episode_fixtures:CountingEnv"):
        load_episode(FunctionEpisodeConfig(function="episode_fixtures:CountingEnv", options={"turn": 1}))


def test_a_turn_text_ends_with_the_stop_string():
    """The tokens stay as sampled; the text the episode and the reward see ends at the stop string."""
    ctx = make_ctx(scripted("ab;cd"), stop=(";",))
    turn = asyncio.run(ctx.generate())
    assert turn.text == "ab;" and turn.token_ids == TOK.encode("ab;cd") + [EOS]
