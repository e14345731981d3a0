"""Prompt claiming and dataset loading."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.data import import_by_path, load_jsonl, prompt_for_sequence
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
    with pytest.raises(UserError, match=r"d.jsonl:2: .*string 'prompt'"):
        load_jsonl(path)
    path.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(UserError, match=r"d.jsonl:2: not valid JSON"):
        load_jsonl(path)


def test_import_by_path_errors():
    assert import_by_path("asyncrl.demo.sort:reward")("sort:ba=", "ab", {"answer": "ab"}) == 1.0
    with pytest.raises(UserError, match="module:function"):
        import_by_path("asyncrl.demo.sort.reward")
    with pytest.raises(UserError, match="cannot import"):
        import_by_path("asyncrl.demo.sort:nope")
