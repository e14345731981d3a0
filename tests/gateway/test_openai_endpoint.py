"""The OpenAI-compatible endpoint of agent episodes, with the real ``openai`` client against the real server
and a scripted model: token identity with the ``ctx`` versions of the demos (byte tokenizer) and of a tool
loop (SmolLM2's chat template), forks, tool calls, rewards, an external agent program, and each way a
request is refused."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap

import httpx
import openai
import pytest
from episode_configs import episode_config

from asyncrl.chat import ChatTokens, Completion
from asyncrl.config import AgentCommandEpisodeConfig, AgentEpisodeConfig, CompletionEpisodeConfig
from asyncrl.demo import calc, calc_agent, guess
from asyncrl.demo.model import build_tokenizer
from asyncrl.episodes import load_episode
from asyncrl.episodes.api import Context, env_episode, run_episode, tool_episode
from asyncrl.episodes.tools import load_parser, load_tools
from asyncrl.errors import UserError
from asyncrl.gateway.agent import agent_episode
from asyncrl.gateway.server import Endpoint, close_endpoint, endpoint_for

TOK = build_tokenizer()
GUESS = "asyncrl.demo.guess_agent:play"


def scripted(chat: ChatTokens, *texts: str):
    """A ``complete`` answering each turn with the next text as the model emits it (with its end-of-turn
    token); turn i's tokens have version i and log-prob -0.1 * (i + 1)."""
    answers = iter(enumerate(texts))

    async def complete(ids: list[int], max_new: int) -> Completion:
        i, text = next(answers)
        tokens = chat.response_ids(text)[:max_new]
        return Completion(tokens, [-0.1 * (i + 1)] * len(tokens), "stop", [i] * len(tokens))

    return complete


def make_ctx(chat: ChatTokens, task: dict, complete, budget: int = 300, max_new: int = 64, **cfg) -> Context:
    ep = CompletionEpisodeConfig(**cfg)
    return Context(
        task=task,
        seed=1,
        prompt_ids=chat.prompt_ids(task["prompt"]),
        complete=complete,
        chat=chat,
        budget=budget,
        max_new_tokens=max_new,
        cfg=ep,
        tools=load_tools(ep.tools),
        parser=load_parser(ep.tool_parser),
        reward=guess.reward if "secret" in task else calc.reward,
    )


def record(ctx: Context) -> tuple:
    return ctx.tokens, ctx.mask, ctx.versions, ctx.logprobs, ctx.turns


def with_endpoint(work):
    """``work(endpoint)`` on a fresh event loop with a started endpoint, closed afterwards."""

    async def main():
        endpoint = Endpoint(max_body=64 * 1024)
        await endpoint.start()
        try:
            return await work(endpoint)
        finally:
            await endpoint.aclose()

    return asyncio.run(main())


def play_agent(endpoint: Endpoint, ctx: Context, **cfg):
    return run_episode(agent_episode(episode_config(**cfg), endpoint), ctx, 60)


# ----- token identity ------------------------------------------------------------------------------------


def test_the_guess_agent_makes_the_env_episodes_tokens():
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 11}
    env_ctx = make_ctx(chat, task, scripted(chat, "8", "12", "x", "11"))
    out = asyncio.run(run_episode(env_episode(guess.Env, max_turns=4), env_ctx, 60))
    agent_ctx = make_ctx(chat, task, scripted(chat, "8", "12", "x", "11"))
    agent_out = with_endpoint(lambda ep: play_agent(ep, agent_ctx, agent="asyncrl.demo.guess_agent:play"))
    assert out.status == agent_out.status == "ok" and out.reward == agent_out.reward == 1.0
    assert record(agent_ctx) == record(env_ctx)
    assert agent_ctx.mask.count(0) == len(TOK.encode("higher;lower;invalid;", add_special_tokens=False))


def test_the_calc_agent_makes_the_ctx_episodes_tokens_with_openai_tool_calls():
    chat, task = ChatTokens(TOK), {"prompt": "calc:37*58=", "answer": "2146"}
    turns = ("<call>calc 37*58</call>", "2146")
    cfg = {"tools": ["asyncrl.demo.calc:calc"], "tool_parser": "simple"}
    ctx_ctx = make_ctx(chat, task, scripted(chat, *turns), **cfg)
    out = asyncio.run(run_episode(calc.episode, ctx_ctx, 60))
    agent_ctx = make_ctx(chat, task, scripted(chat, *turns), tool_parser="simple")
    agent_out = with_endpoint(lambda ep: play_agent(ep, agent_ctx, agent="asyncrl.demo.calc_agent:play"))
    assert out.parts == agent_out.parts == {"reward": 1.0}  # the agent returned None: data.reward scored it
    assert record(agent_ctx) == record(ctx_ctx) and agent_ctx.turns == 2


CALC_TOOL = {"type": "function", "name": "calc", "parameters": calc_agent.CALC["function"]["parameters"]}


async def calc_responses_agent(client, task, chained: bool = False, stream: bool = False):
    """calc_agent's round through the Responses API, as the Agents SDK speaks it by default: the tool's output as
    a ``function_call_output`` item after the response's own output items (``chained``: after
    ``previous_response_id`` instead)."""
    items = [{"role": "user", "content": task["prompt"]}]
    first = await client.responses.create(model="policy", input=items, tools=[CALC_TOOL])
    calls = [o for o in first.output if o.type == "function_call"]
    if not calls:
        return None
    result = calc_agent.calculate(json.loads(calls[0].arguments)["expression"])
    output = {"type": "function_call_output", "call_id": calls[0].call_id, "output": result + ";"}
    if chained:
        request = {"input": [output], "previous_response_id": first.id}
    else:
        request = {"input": [*items, *(o.model_dump(exclude_none=True) for o in first.output), output]}
    if not stream:
        second = await client.responses.create(model="policy", tools=[CALC_TOOL], **request)
        task["said"] = second.output_text
        return None
    stream = await client.responses.create(model="policy", tools=[CALC_TOOL], stream=True, **request)
    events = [e async for e in stream]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    task["said"] = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert task["said"] == events[-1].response.output_text
    return None


@pytest.mark.parametrize("how", ["items", "chained", "streamed"])
def test_a_responses_api_agent_makes_the_ctx_episodes_tokens(how):
    chat, task = ChatTokens(TOK), {"prompt": "calc:37*58=", "answer": "2146"}
    turns = ("<call>calc 37*58</call>", "2146")
    cfg = {"tools": ["asyncrl.demo.calc:calc"], "tool_parser": "simple"}
    ctx_ctx = make_ctx(chat, task, scripted(chat, *turns), **cfg)
    asyncio.run(run_episode(calc.episode, ctx_ctx, 60))
    agent_ctx = make_ctx(chat, dict(task), scripted(chat, *turns), tool_parser="simple")
    agent = f"{__name__}:calc_responses_{how}"
    out = with_endpoint(lambda ep: play_agent(ep, agent_ctx, agent=agent))
    assert out.status == "ok" and out.parts == {"reward": 1.0}, out.detail
    assert record(agent_ctx) == record(ctx_ctx) and agent_ctx.turns == 2
    assert agent_ctx.task["said"] == "2146" and agent_ctx.tool_failures["agent_fork"] == 0


async def calc_responses_items(client, task):
    return await calc_responses_agent(client, task)


async def calc_responses_chained(client, task):
    return await calc_responses_agent(client, task, chained=True)


async def calc_responses_streamed(client, task):
    return await calc_responses_agent(client, task, stream=True)


@pytest.mark.parametrize("said", ["<call>calc 37*58</call>", "<call>calcc 37*58</call>"])
def test_an_agents_sdk_agent_with_its_default_responses_model(said):
    """The SDK's own agent loop, its defaults untouched: a right call round trips token for token with the ctx
    version; a misspelt tool is the plain answer it is (the SDK raised ModelBehaviorError before), scored 0."""
    pytest.importorskip("agents")
    chat, task = ChatTokens(TOK), {"prompt": "calc:37*58=", "answer": "2146"}
    turns = (said, "2146")
    ctx_ctx = make_ctx(chat, task, scripted(chat, *turns), tools=["asyncrl.demo.calc:calc"], tool_parser="simple")
    asyncio.run(run_episode(calc.episode, ctx_ctx, 60))
    agent_ctx = make_ctx(chat, dict(task), scripted(chat, *turns), tool_parser="simple")
    out = with_endpoint(lambda ep: play_agent(ep, agent_ctx, agent="sdk_calc_agent:play"))
    assert out.status == "ok", out.detail
    if "calcc" not in said:
        assert out.parts == {"reward": 1.0} and agent_ctx.task["said"] == "2146"
        assert record(agent_ctx) == record(ctx_ctx) and agent_ctx.turns == 2
    else:
        assert out.parts == {"reward": 0.0} and agent_ctx.task["said"] == said and agent_ctx.turns == 1
        assert agent_ctx.tool_failures["agent_untrusted_call"] == 1


async def refused_responses_agent(client, task):
    """Each malformed Responses request gets its 400 and changes nothing; then the turn as usual."""
    import openai

    user = {"role": "user", "content": task["prompt"]}
    bad = [
        ({"input": [user, {"type": "computer_call", "action": {}}]}, "unsupported_content"),
        ({"input": [user, {"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "invalid_request"),
        ({"input": [user], "previous_response_id": "resp_none"}, "previous_response_not_found"),
        ({"input": [user], "reasoning": {"effort": "high"}}, "unsupported_parameter"),
        ({"input": [user], "tools": [{"type": "web_search"}]}, "unsupported_parameter"),
        ({"input": []}, "invalid_request"),
    ]
    for request, code in bad:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model="policy", **request)
        assert refused.value.code == code, (request, refused.value)
    r = await client.responses.create(model="policy", input=task["prompt"], include=["message.output_text.logprobs"])
    assert r.output_text == "8" and [lp.logprob for lp in r.output[0].content[0].logprobs] == [-0.1, -0.1]
    return None


def test_malformed_responses_requests_are_refused_by_name_and_leave_the_sample_as_it_was():
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 8}
    ctx = make_ctx(chat, task, scripted(chat, "8"))
    out = with_endpoint(lambda ep: play_agent(ep, ctx, agent=f"{__name__}:refused_responses_agent"))
    assert out.status == "ok", out.detail
    assert ctx.tokens == chat.response_ids("8") and ctx.turns == 1


async def upper_agent(client, task):
    """A hermes tool loop over the OpenAI API: what ``tool_episode`` does with ``upper``."""
    tools = [{"type": "function", "function": {"name": "upper", "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": task["prompt"]}]
    while True:
        r = await client.chat.completions.create(model="m", messages=messages, tools=tools, logprobs=True)
        message = r.choices[0].message
        entries = r.choices[0].logprobs.content
        assert len(entries) == r.usage.completion_tokens and len({e.logprob for e in entries}) == 1
        if not message.tool_calls:
            return None
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = json.loads(call.function.arguments)["text"].upper()
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


def test_token_identity_under_smollm2s_chat_template(smollm2):  # noqa: F811 - the fixture
    chat, task = ChatTokens(smollm2), {"prompt": "Shout hi and yo.", "answer": "HI"}
    call = '<tool_call>{"name": "upper", "arguments": {"text": "%s"}}</tool_call>'
    turns = (call % "hi" + call % "yo", call % "again", "Done: HI YO AGAIN.")
    ctx_ctx = make_ctx(chat, task, scripted(chat, *turns), tools=["episode_fixtures:upper"], tool_parser="hermes")
    out = asyncio.run(run_episode(tool_episode(4), ctx_ctx, 60))
    agent_ctx = make_ctx(chat, task, scripted(chat, *turns), tool_parser="hermes")
    agent_out = with_endpoint(
        lambda ep: play_agent(ep, agent_ctx, agent=f"{__name__}:upper_agent", tool_parser="hermes")
    )
    assert out.status == agent_out.status == "ok" and out.parts == agent_out.parts
    assert record(agent_ctx) == record(ctx_ctx) and agent_ctx.turns == 3
    assert agent_ctx.tool_failures["agent_fork"] == 0
    assert smollm2.decode(agent_ctx.prompt_ids + agent_ctx.tokens).count("<|im_start|>tool\nHI\nYO<|im_end|>") == 1


async def strict_agent(client, task):
    """What an agent framework does with an answer: runs its tool calls, each by a name it declared with JSON
    arguments (else it raises, as the Agents SDK's ``ModelBehaviorError``); ends on an answer without calls."""
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
        for n in ("upper", "lower")
    ]
    messages, seen = [{"role": "user", "content": task["prompt"]}], []
    while True:
        r = await client.chat.completions.create(model="m", messages=messages, tools=tools)
        message = r.choices[0].message
        seen.append((message.content, [c.function.name for c in message.tool_calls or ()], r.choices[0].finish_reason))
        if not message.tool_calls:
            task["seen"] = seen
            return None
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            assert call.function.name in ("upper", "lower"), call
            text = json.loads(call.function.arguments)["text"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text.upper()})


def test_only_calls_to_declared_tools_with_json_arguments_come_back_as_tool_calls(smollm2):  # noqa: F811
    """The model's other calls stay in the content as it wrote them (the sample's tokens unchanged, each
    counted as ``tools/agent_untrusted_call``): an agent framework is never handed a call it cannot run."""
    chat, task = ChatTokens(smollm2), {"prompt": "Shout hi.", "answer": "HI"}
    call = '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'
    turns = (
        call % ("upper", '{"text": "hi"}') + call % ("shout", '{"text": "yo"}') + call % ("upper", "[1, 2"),
        call % ("uper", '{"text": "hi"}'),
    )
    ctx = make_ctx(chat, task, scripted(chat, *turns), budget=600, max_new=200, tool_parser="hermes")
    out = with_endpoint(lambda ep: play_agent(ep, ctx, agent=f"{__name__}:strict_agent", tool_parser="hermes"))
    assert out.status == "ok", out.detail
    first, last = task["seen"]
    # the declared call with JSON arguments is a tool call, cut from the content; the undeclared one and the
    # one whose arguments are no JSON object stay as the model wrote them
    assert first == (call % ("shout", '{"text": "yo"}') + call % ("upper", "[1, 2"), ["upper"], "tool_calls")
    assert last == (call % ("uper", '{"text": "hi"}'), [], "stop")  # a plain answer: the agent ends
    assert ctx.tool_failures["agent_untrusted_call"] == 3 and ctx.turns == 2
    model = [t for t, m in zip(ctx.tokens, ctx.mask, strict=True) if m]
    assert model == chat.response_ids(turns[0]) + chat.response_ids(turns[1])  # the tokens as sampled


def test_a_misspelt_tool_is_a_plain_answer_that_trains_as_a_wrong_one():
    """The calc demo's tiny model writes ``<call>calcc 37*58</call>``: the agent gets it as text, answers with
    it, and the episode is scored (0.0) instead of failing its group."""
    chat, task = ChatTokens(TOK), {"prompt": "calc:37*58=", "answer": "2146"}
    ctx = make_ctx(chat, task, scripted(chat, "<call>calcc 37*58</call>"), tool_parser="simple")
    out = with_endpoint(lambda ep: play_agent(ep, ctx, agent="asyncrl.demo.calc_agent:play"))
    assert out.status == "ok" and out.parts == {"reward": 0.0}
    assert ctx.tool_failures["agent_untrusted_call"] == 1 and ctx.turns == 1


class ModelBehaviorError(Exception):
    """What the Agents SDK raises over a model's output it cannot act on (``agents.exceptions``)."""


async def fussy_agent(client, task):
    """Asks once, then gives up over the answer as an agent framework does."""
    r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    raise ModelBehaviorError(f"cannot act on {r.choices[0].message.content!r}")


async def unreachable_agent(client, task):
    """Its client points at a port nothing listens on: the endpoint never reached."""
    import openai

    lost = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="k", max_retries=0)
    await lost.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])


@pytest.mark.parametrize(
    ("fields", "status", "reward"),
    [({}, "ok", 0.0), ({"agent_error_reward": -1.0}, "ok", -1.0), ({"on_agent_error": "fail"}, "agent_error", None)],
)
def test_an_agent_that_gives_up_over_the_models_output_scores_a_failed_attempt(fields, status, reward):
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 9}
    ctx = make_ctx(chat, task, scripted(chat, "x"))
    out = with_endpoint(lambda ep: play_agent(ep, ctx, agent=f"{__name__}:fussy_agent", **fields))
    assert out.status == status and ctx.turns == 1
    if reward is not None:  # trained as the wrong answer it was, and counted
        assert out.reward == reward and ctx.tool_failures["agent_raised"] == 1
    else:
        assert "ModelBehaviorError" in out.detail and "cannot act on 'x'" in out.detail


def test_an_agent_that_cannot_reach_the_endpoint_fails_its_episode_whatever_the_setting():
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 9}
    ctx = make_ctx(chat, task, scripted(chat))
    out = with_endpoint(lambda ep: play_agent(ep, ctx, agent=f"{__name__}:unreachable_agent"))
    assert out.status == "agent_error" and "APIConnectionError" in out.detail
    assert ctx.tool_failures["agent_raised"] == 0


# ----- forks ------------------------------------------------------------------------------------------


async def rewriting_agent(client, task):
    """Two turns, then a third request that rewrites the first answer: the sample forks."""
    msgs = [{"role": "user", "content": task["prompt"]}]
    first = (await client.chat.completions.create(model="m", messages=msgs)).choices[0].message.content
    msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "lower;"}]
    await client.chat.completions.create(model="m", messages=msgs)
    msgs[1] = {"role": "assistant", "content": "4"}  # not what the model said
    third = await client.chat.completions.create(model="m", messages=msgs)
    return float(third.choices[0].message.content == "2")


def test_a_rewritten_history_forks_the_sample_and_is_counted():
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 2}
    ctx = make_ctx(chat, task, scripted(chat, "8", "3", "2"))
    out = with_endpoint(lambda ep: play_agent(ep, ctx, agent=f"{__name__}:rewriting_agent"))
    assert out.status == "ok" and out.reward == 1.0 and ctx.tool_failures["agent_fork"] == 1
    # the last branch only: the prompt, the agent's "4" (context), its observation, the third turn
    four, lower, two = chat.response_ids("4"), TOK.encode("lower;", add_special_tokens=False), chat.response_ids("2")
    assert ctx.tokens == four + lower + two and ctx.mask == [0] * (len(four) + len(lower)) + [1] * len(two)
    assert ctx.versions[-1] == 2 and ctx.turns == 1


# ----- the client's calls, retries, completions, rewards ---------------------------------------------------


async def many_calls_agent(client, task):
    models = await client.models.list()
    assert [m.id for m in models.data] == ["policy"]
    prompt = task["prompt"]
    first = await client.completions.create(model="policy", prompt=prompt, logprobs=1, max_tokens=3)
    assert first.choices[0].text == "8" and first.usage.completion_tokens == 2
    assert first.choices[0].logprobs.token_logprobs == [-0.1, -0.1]
    second = await client.completions.create(model="policy", prompt=prompt + "8" + "higher;", stop=["2"])
    assert second.choices[0].text == "1" and second.choices[0].finish_reason == "stop"
    return {"found": 0.5, "speed": 0.25}


def test_completions_models_stop_and_reward_parts():
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 12}
    ctx = make_ctx(chat, task, scripted(chat, "8", "12"))
    out = with_endpoint(lambda ep: play_agent(ep, ctx, agent=f"{__name__}:many_calls_agent"))
    assert out.status == "ok", out.detail
    assert out.parts == {"found": 0.5, "speed": 0.25}
    higher = TOK.encode("higher;", add_special_tokens=False)
    assert ctx.tokens == chat.response_ids("8") + higher + chat.response_ids("12")


async def streaming_agent(client, task):
    msgs = [{"role": "user", "content": task["prompt"]}]
    stream = await client.chat.completions.create(model="m", messages=msgs, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    again = await client.chat.completions.create(model="m", messages=msgs)  # a retry: the same answer
    assert again.choices[0].message.content == text == "5"
    return None


def test_streaming_a_retry_and_data_reward_on_the_final_answer():
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 5}
    ctx = make_ctx(chat, task, scripted(chat, "5"))
    out = with_endpoint(lambda ep: play_agent(ep, ctx, agent=f"{__name__}:streaming_agent"))
    assert out.status == "ok" and out.reward == 1.0 and ctx.turns == 1


AGENT_PROGRAM = textwrap.dedent(
    """
    import json, os, sys, httpx, openai
    task = json.load(sys.stdin)
    client = openai.OpenAI()
    r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["prompt"]}])
    text = r.choices[0].message.content
    headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}
    httpx.post(os.environ["ASYNCRL_REWARD_URL"], json={"reward": 0.25 + (text == "9")}, headers=headers)
    """
)


def test_an_external_agent_program(tmp_path):
    program = tmp_path / "agent.py"
    program.write_text(AGENT_PROGRAM)
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 9}
    ctx = make_ctx(chat, task, scripted(chat, "9"))
    out = with_endpoint(lambda ep: play_agent(ep, ctx, agent_command=[sys.executable, str(program)]))
    assert out.status == "ok" and out.reward == 1.25 and ctx.turns == 1

    failing = tmp_path / "failing.py"
    failing.write_text("import sys; print('no luck', file=sys.stderr); sys.exit(3)")
    ctx = make_ctx(chat, task, scripted(chat))
    out = with_endpoint(lambda ep: play_agent(ep, ctx, agent_command=f"{sys.executable} {failing}"))
    assert out.status == "agent_error" and "exited with 3: no luck" in out.detail
    gave_up = tmp_path / "gave_up.py"  # exit 10: the model's output made it give up -> a failed attempt
    gave_up.write_text("import sys; sys.exit(10)")
    ctx = make_ctx(chat, task, scripted(chat))
    out = with_endpoint(lambda ep: play_agent(ep, ctx, agent_command=[sys.executable, str(gave_up)]))
    assert out.status == "ok" and out.reward == 0.0 and ctx.tool_failures["agent_raised"] == 1


def test_agent_programs_wait_for_a_slot_and_the_wait_is_not_their_timeout(tmp_path):
    """``episode.agent_processes: 1``: three episodes at once run their programs one after another (each sees
    itself alone, 0.4 s each); the last one waited for the two before it, and that wait is the run's time
    (``engine_seconds``, out of its timeout), not its own."""
    program = tmp_path / "slot.py"
    program.write_text(
        textwrap.dedent(f"""
        import os, pathlib, time
        me = pathlib.Path({str(tmp_path)!r}) / f"running-{{os.getpid()}}"
        me.touch()
        alone = len(list(me.parent.glob("running-*")))
        time.sleep(0.4)
        me.unlink()
        with open({str(tmp_path / "seen")!r}, "a") as f:
            f.write(f"{{alone}}\\n")
        """)
    )
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 9}
    cfg = AgentCommandEpisodeConfig(agent_command=[sys.executable, str(program)], agent_processes=1)

    async def three(endpoint):
        episode = agent_episode(cfg, endpoint)
        ctxs = [make_ctx(chat, task, scripted(chat)) for _ in range(3)]
        outs = await asyncio.gather(*(run_episode(episode, ctx, 60) for ctx in ctxs))
        return outs, sorted(ctx.engine_seconds for ctx in ctxs)

    outs, waited = with_endpoint(three)
    assert [o.status for o in outs] == ["agent_error"] * 3  # no model turn: nothing for data.reward to score
    assert all("without asking the model" in o.detail for o in outs)
    assert (tmp_path / "seen").read_text().split() == ["1", "1", "1"]
    assert waited[-1] >= 2 * 0.4  # behind two programs that each held the slot for 0.4 s at least


def test_an_agent_program_past_the_episodes_timeout_is_killed(tmp_path):
    pid_file = tmp_path / "pid"
    program = tmp_path / "hang.py"
    program.write_text(f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(3600)")
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 9}
    ctx = make_ctx(chat, task, scripted(chat))
    episode = agent_episode(AgentCommandEpisodeConfig(agent_command=[sys.executable, str(program)]))
    out = asyncio.run(run_episode(episode, ctx, 3.0))  # time enough for the program to start on a busy machine
    assert out.status == "episode_timeout"
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed (and reaped) when its episode was cancelled


def test_a_cancelled_episode_ends_after_its_agents_turn_is_cancelled():
    """The generator cancels an episode (shutdown): the turn waiting for the engine is cancelled first."""
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 9}
    events: list[str] = []
    entered = asyncio.Event()

    async def waiting(ids: list[int], max_new: int) -> Completion:
        entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            events.append("turn cancelled")
            raise

    async def main(endpoint: Endpoint):
        ctx = make_ctx(chat, task, waiting)
        running = asyncio.create_task(play_agent(endpoint, ctx, agent=GUESS))
        await entered.wait()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        events.append("episode ended")
        return endpoint.sessions

    assert with_endpoint(main) == {} and events == ["turn cancelled", "episode ended"]


def test_an_agent_that_overruns_the_budget_fails_the_episode():
    chat, task = ChatTokens(TOK), {"prompt": guess.PROMPT, "secret": 16}
    ctx = make_ctx(chat, task, scripted(chat, "1", "2", "3", "4"), budget=8)
    out = with_endpoint(lambda ep: play_agent(ep, ctx, agent="asyncrl.demo.guess_agent:play"))
    assert out.status == "budget"


# ----- refusals -----------------------------------------------------------------------------------------


async def refusals(endpoint: Endpoint) -> dict:
    chat = ChatTokens(TOK)
    task = {"prompt": guess.PROMPT, "secret": 3}
    mine = endpoint.open(make_ctx(chat, task, scripted(chat, "3")), load_parser("simple"), "simple")
    other = endpoint.open(make_ctx(chat, task, scripted(chat)), load_parser("simple"), "simple")
    done = endpoint.open(make_ctx(chat, task, scripted(chat)), load_parser("simple"), "simple")
    endpoint.close(done)
    msgs = [{"role": "user", "content": task["prompt"]}]
    seen = {}
    cases = {
        "no_key": (mine, None, {"messages": msgs}),
        "other_key": (mine, other.key, {"messages": msgs}),
        "finished": (done, done.key, {"messages": msgs}),
        "malformed": (mine, mine.key, b'{"messages": ['),
        "unsupported": (mine, mine.key, {"messages": msgs, "logit_bias": {"1": 5}}),
        "n": (mine, mine.key, {"messages": msgs, "n": 2}),
        "oversize": (mine, mine.key, {"messages": msgs, "user": "x" * 100_000}),
        "deep": (mine, mine.key, {"messages": msgs, "metadata": json.loads("[" * 80 + "]" * 80)}),
        "prompt": (mine, mine.key, {"messages": [{"role": "user", "content": "guess:1-99="}]}),
        "image": (mine, mine.key, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    }
    async with httpx.AsyncClient() as http:
        for name, (session, key, body) in cases.items():
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await http.post(f"{session.url}/chat/completions", content=content, headers=headers)
            seen[name] = (r.status_code, r.json()["error"])
        ok = await openai.AsyncOpenAI(base_url=mine.url, api_key=mine.key).chat.completions.create(
            model="m", messages=msgs
        )
        seen["after"] = ok.choices[0].message.content
        client = openai.AsyncOpenAI(base_url=mine.url, api_key=mine.key)  # over the socket: the retry, streamed
        stream = await client.chat.completions.create(model="m", messages=msgs, stream=True)
        seen["streamed"] = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        try:
            await openai.AsyncOpenAI(base_url=mine.url, api_key=other.key, max_retries=0).models.list()
        except openai.AuthenticationError as e:
            seen["sdk"] = e.status_code
    seen["untouched"] = (len(mine.conversation.ctx.tokens), len(other.conversation.ctx.tokens))
    return seen


def test_bad_requests_get_openai_error_objects_and_touch_no_session():
    seen = with_endpoint(refusals)
    expect = {
        "no_key": (401, "invalid_api_key"),
        "other_key": (401, "invalid_api_key"),
        "finished": (404, "session_finished"),
        "malformed": (400, "invalid_json"),
        "unsupported": (400, "unsupported_parameter"),
        "n": (400, "unsupported_parameter"),
        "oversize": (413, "body_too_large"),
        "deep": (400, "invalid_json"),
        "prompt": (400, "prompt_mismatch"),
        "image": (400, "unsupported_content"),
    }
    for name, (status, code) in expect.items():
        got_status, error = seen[name]
        assert (got_status, error["code"]) == (status, code), (name, error)
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert seen["unsupported"][1]["param"] == "logit_bias"
    assert seen["after"] == seen["streamed"] == "3" and seen["sdk"] == 401
    assert seen["untouched"] == (len(ChatTokens(TOK).response_ids("3")), 0)


def test_an_event_loop_has_one_endpoint_until_the_generator_closes_it():
    async def main():
        first, again = await asyncio.gather(endpoint_for("127.0.0.1", 0), endpoint_for("127.0.0.1", 0))
        url = f"http://127.0.0.1:{first.port}/sessions/x/v1/models"
        async with httpx.AsyncClient() as http:
            served = (await http.get(url)).status_code
            await close_endpoint()
            with pytest.raises(httpx.ConnectError):
                await http.get(url)
        await close_endpoint()  # none left: nothing to do
        return first is again, served

    same, served = asyncio.run(main())
    assert same and served == 401  # one endpoint per loop; a request without a key is refused, not lost


def test_config_names_one_episode_and_load_episode_builds_the_agent():
    with pytest.raises(ValueError, match="give one"):
        episode_config(agent="asyncrl.demo.guess_agent:play", function="asyncrl.demo.guess:Env")
    with pytest.raises(UserError, match="async def agent"):
        load_episode(AgentEpisodeConfig(agent="asyncrl.demo.guess:reward"))
    episode, _, _ = load_episode(AgentCommandEpisodeConfig(agent_command="true"))
    assert callable(episode)


# ----- a real engine ----------------------------------------------------------------------------------


class _NoMetrics:
    def log(self, record: dict) -> None:
        pass


def test_a_real_engine_gives_the_agent_and_the_env_episode_the_same_tokens(tiny_model_dir):
    """The transformers engine, greedy, behind the generator's pump: the guess Env's episode and the guess
    agent's, one after the other on one loop, sample the same tokens with the same masks and versions."""
    import dataclasses

    from transformers import AutoTokenizer

    from asyncrl.config import load_config
    from asyncrl.generators.engine import Sampling
    from asyncrl.generators.hf_engine import HfEngine
    from asyncrl.generators.scheduler import EnginePump
    from asyncrl.generators.weight_feed import WeightFeed
    from asyncrl.weights import MemoryWeightBus

    engine = HfEngine(load_config(None, {"model.path": str(tiny_model_dir), "model.recipe": None}).model, seed=0)
    chat = ChatTokens(AutoTokenizer.from_pretrained(tiny_model_dir))
    sampling = Sampling(1, 0.0, 1.0, 4, tuple(chat.stop_token_ids))
    task = {"prompt": guess.PROMPT, "secret": 16}

    async def main():
        feed = WeightFeed(MemoryWeightBus().subscriber("t", have=0), _NoMetrics(), lambda **_: None)
        pump = EnginePump(engine, feed, "wait")
        runner = asyncio.create_task(pump.run())
        endpoint = Endpoint()
        await endpoint.start()
        try:
            played = []
            for episode in (
                env_episode(guess.Env, max_turns=4),
                agent_episode(AgentEpisodeConfig(agent=GUESS), endpoint),
            ):
                complete = lambda ids, n: pump.complete(ids, dataclasses.replace(sampling, max_new_tokens=n))  # noqa: E731
                ctx = make_ctx(chat, task, complete, max_new=4)  # the guess agent asks for 4 tokens a turn
                played.append((await run_episode(episode, ctx, 60), ctx))
            return played
        finally:
            await endpoint.aclose()
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    (env_out, env_ctx), (agent_out, agent_ctx) = asyncio.run(main())
    assert env_out.status == agent_out.status == "ok" and env_out.reward == agent_out.reward
    # The Env version also observes the environment's reply to its last turn (env_episode does, when the
    # turns run out): context after the last model token, which the agent never sends. Up to it, identical.
    end = len(agent_ctx.tokens)
    assert agent_ctx.mask[-1] == 1 and set(env_ctx.mask[end:]) <= {0}
    cut = (env_ctx.tokens[:end], env_ctx.mask[:end], env_ctx.versions[:end], env_ctx.logprobs[:end], env_ctx.turns)
    assert record(agent_ctx) == cut and agent_ctx.turns == 4 and 0 in agent_ctx.mask
