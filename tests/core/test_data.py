"""Prompt claiming and dataset loading."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.data import import_by_path, load_jsonl, prompt_for_sequence, prompt_of
from asyncrl.errors import UserError


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 60), st.integers(0, 3), st.integers(0, 2**16))
def test_every_prompt_is_claimed_once_per_epoch(num_prompts, epochs, seed):
    claims = [prompt_for_sequence(s, num_prompts, seed) for s in range((epochs + 1) * num_prompts)]
    for epoch in range(epochs + 1):
        indices = [idx for e, idx in claims if e == epoch]
        assert sorted(indices) == list(range(num_prompts))


def test_load_jsonl_names_the_bad_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": 3}\n')
    with pytest.raises(UserError, match=r"d.jsonl:2: 'prompt' must be a string"):
        load_jsonl(path)
    path.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(UserError, match=r"d.jsonl:2: not valid JSON"):
        load_jsonl(path)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"answer": "x"}', "string 'prompt' or a list of chat 'messages'"),
        ('{"prompt": "a", "messages": []}', "string 'prompt' or a list of chat 'messages'"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "user"}]}', r"messages\[0\] must be an object with a string 'role' and a 'content'"),
        ('{"messages": [{"role": "user", "content": [{"type": "audio"}]}]}', r"messages\[0\] .* 'image'\} parts"),
        ('{"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}', r"messages\[0\] .*parts"),
        ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]}', "assistant"),
    ],
)
def test_load_jsonl_checks_chat_messages(tmp_path, line, problem):
    path = tmp_path / "d.jsonl"
    path.write_text('{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}\n' + line)
    with pytest.raises(UserError, match=rf"d.jsonl:2: .*{problem}"):
        load_jsonl(path)


def test_prompt_of_gives_the_string_or_the_messages():
    chat = [{"role": "user", "content": "q"}]
    assert prompt_of({"prompt": "p", "answer": 1}) == "p"
    assert prompt_of({"messages": chat}) == chat


def test_import_by_path_errors():
    assert import_by_path("asyncrl.demo.sort:reward")("sort:ba=", "ab", {"answer": "ab"}) == 1.0
    with pytest.raises(UserError, match="module:function"):
        import_by_path("asyncrl.demo.sort.reward")
    with pytest.raises(UserError, match="cannot import"):
        import_by_path("asyncrl.demo.sort:nope")
