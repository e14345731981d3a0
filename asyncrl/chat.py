"""Token ids of a multi-turn conversation, built turn by turn without ever re-tokenizing a model turn.

A model turn's tokens are the engine's own: they are never decoded and encoded again (that silently
changes ids, and so log-probs). What goes between two model turns (the end of the assistant message,
the environment's or tool's message, the next generation prompt) comes from the tokenizer's chat
template: the TEMPLATE's text around a ``role`` message is found once per role, as the difference of
two renders of a fixed base conversation; each observation is then that closing + head, its text and
that tail, encoded as ONE string. Never as three pieces: BPE pre-tokenization merges across the
seams, so pieces give other ids than a full render (SmolLM2, ␣ a space: ``"tool\\n  x"`` is ``tool``,
``\\n␣``, ``␣x``, but ``"tool\\n"`` and ``"  x"`` apart are ``tool``, ``\\n`` and ``␣``,
``␣x``). Tokenizers without a chat template (the demo's byte tokenizer) use plain encoding: the
prompt's ids, then each turn's, each observation's, with nothing between them (a turn cut by length
gets no EOS).

Invariant, pinned by ``tests/episodes/test_chat_tokens.py``: for a conversation whose assistant turns are
encoded the way the model emits them (content, then the end-of-turn token, or the content alone for a
turn cut by length), ``prompt_ids(user) + turn_1 + observation_ids(obs_1, after=turn_1) + turn_2 + ...``
equals the one full render of the whole conversation with a generation prompt, token for token.

Where it cannot hold, by design: ids at a seam with a MODEL turn are the model's. A turn whose
content begins with whitespace (``"\\n"`` + ``"  x"`` after the generation prompt) or a template whose
closing begins with plain text would be tokenized differently by a full render; the sample keeps the
sampled ids, and the observation after the turn is the same either way. A template that rewrites
earlier messages when one is appended (not append-only) is refused with ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncrl.errors import UserError

if TYPE_CHECKING:
    import numpy as np

# Placeholder contents of the base conversation; any text the template copies verbatim will do.
_BASE_USER, _BASE_ASSISTANT = "Hi.", "Hello."


@dataclasses.dataclass
class Completion:
    """One model turn as the engine sampled it: what an engine (``asyncrl.generators``) hands an episode
    (``asyncrl.episodes``), which appends it to its conversation's ids unchanged."""

    tokens: list[int]  # (T,) response token ids, EOS included when the model stopped
    logprobs: list[float]  # (T,) behaviour log-probs of the sampled tokens
    finish_reason: str  # "stop" | "length"
    versions: list[int] = dataclasses.field(default_factory=list)  # (T,) version that produced each token
    # rollout routing replay (a mixture of experts): the (positions, layers, top_k) uint8 experts the engine
    # routed each position of context and turn to, but the turn's last token (generators.vllm_routes)
    routes: np.ndarray | None = None


class ChatTokens:
    def __init__(self, tokenizer, *, use_template: bool = True, system_prompt: str | None = None):
        """``use_template`` False (or a tokenizer without one) gives plain encoding; ``system_prompt``
        opens every templated conversation (None: whatever the template does without one)."""
        self.tok = tokenizer
        self.templated = bool(use_template and getattr(tokenizer, "chat_template", None))
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []

    def prompt_ids(self, prompt: str | list[dict]) -> list[int]:
        """The task's prompt, ending with the generation prompt: a string is the first user message, a
        list is the chat ``messages`` (``system_prompt`` opens it unless it has a system message)."""
        if not self.templated:
            if not isinstance(prompt, str):
                raise UserError(self._no_template)
            return list(self.tok.encode(prompt))
        return self._render(self._messages(prompt), generation_prompt=True)

    def prompt_text(self, prompt: str | list[dict]) -> str:
        """The prompt as a reward function receives it: a string as written; chat messages rendered by
        the template (the generation prompt included)."""
        if isinstance(prompt, str):
            return prompt
        if not self.templated:
            raise UserError(self._no_template)
        return self._text(self._messages(prompt), generation_prompt=True)

    def _messages(self, prompt: str | list[dict]) -> list[dict]:
        if isinstance(prompt, str):
            return [*self.system, {"role": "user", "content": prompt}]
        has_system = any(m["role"] == "system" for m in prompt)
        return [*([] if has_system else self.system), *({"role": m["role"], "content": m["content"]} for m in prompt)]

    @property
    def _no_template(self) -> str:
        why = "episode.chat_template is false" if getattr(self.tok, "chat_template", None) else "it has none"
        return f"chat 'messages' need the tokenizer's chat template, and {why}: give plain 'prompt' strings"

    def observation_ids(self, text: str, role: str, after: Sequence[int]) -> list[int]:
        """What follows the model turn ``after`` (its token ids as sampled): the rest of the assistant
        message, a ``role`` message with ``text``, and the next generation prompt."""
        if not self.templated:
            return list(self.tok.encode(text, add_special_tokens=False))
        between, closing, tail = self._frame(role)
        ids = list(self.tok.encode(between + text + tail, add_special_tokens=False))  # one string: see above
        emitted = _overlap(after, closing)  # the part of the closing the model already emitted
        if ids[:emitted] != closing[:emitted]:
            raise ValueError(f"the chat template's closing merges with the {role!r} message's tokens")
        return ids[emitted:]

    @property
    def stop_token_ids(self) -> list[int]:
        """Tokens that end a model turn: EOS and, under a template, the assistant message's end."""
        ids = {self.tok.eos_token_id} if self.tok.eos_token_id is not None else set()
        if self.templated:
            closing = self._frame("user")[1]
            special = set(getattr(self.tok, "all_special_ids", []))
            ids |= {t for t in closing if t in special}
        return sorted(ids)

    @property
    def pad_id(self) -> int:
        """The id that pads batches: the tokenizer's pad token, else EOS, else 0 (attention masks it out)."""
        return next(t for t in (self.tok.pad_token_id, self.tok.eos_token_id, 0) if t is not None)

    def response_ids(self, text: str) -> list[int]:
        """An assistant reply as the model should emit it: its tokens and the token that ends the turn
        (under a template, the assistant message's first special closing token; else EOS, if any)."""
        ids = list(self.tok.encode(text, add_special_tokens=False))
        if self.templated:
            special = set(getattr(self.tok, "all_special_ids", []))
            end = next((t for t in self._frame("user")[1] if t in special), self.tok.eos_token_id)
        else:
            end = self.tok.eos_token_id
        return ids + ([end] if end is not None else [])

    # -- the renders, once per role ------------------------------------------------------------------
    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        text = self._text(messages, generation_prompt)
        return list(self.tok.encode(text, add_special_tokens=False))

    def _text(self, messages: list[dict], generation_prompt: bool) -> str:
        if self._takes_parts:
            messages = [{**m, "content": _as_parts(m["content"])} for m in messages]
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    @functools.cached_property
    def _takes_parts(self) -> bool:
        """Whether the template renders a message's content only as a list of parts (vision-language models'
        templates: SmolVLM's iterates over ``{"type": "text" | "image"}`` parts and renders a string as nothing):
        every string content (the task's, an environment's, the base conversations') then goes in as one text
        part."""

        def render(content) -> str:
            return self.tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False)

        return _BASE_USER not in render(_BASE_USER) and _BASE_USER in render(_as_parts(_BASE_USER))

    @functools.lru_cache(maxsize=8)  # noqa: B019 - one instance per generator, a handful of roles
    def _frame(self, role: str) -> tuple[str, list[int], str]:
        """(between, closing ids, tail): the template's text from the end of an assistant message's
        content to the start of a ``role`` message's content, the closing's own ids (the part that a
        model turn may end with), and the text from that content's end to the next generation prompt."""
        marker = "\x00obs\x00"
        base = [*self.system, {"role": "user", "content": _BASE_USER}]
        with_reply = [*base, {"role": "assistant", "content": _BASE_ASSISTANT}]
        before = self._text(with_reply, generation_prompt=False)
        after = self._text([*with_reply, {"role": role, "content": marker}], generation_prompt=True)
        if not after.startswith(before):
            raise ValueError(f"the chat template is not append-only after an assistant turn (role {role!r})")
        if after.count(marker) != 1:
            raise ValueError(f"the chat template does not copy a {role!r} message's content verbatim")
        closing = before[before.rindex(_BASE_ASSISTANT) + len(_BASE_ASSISTANT) :]
        head, _, tail = after[len(before) :].partition(marker)
        return closing + head, list(self.tok.encode(closing, add_special_tokens=False)), tail


def _as_parts(content: str | list[dict]) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _overlap(turn: Sequence[int], closing: Sequence[int]) -> int:
    """Length of the longest prefix of ``closing`` that ``turn`` ends with (the model emits the
    end-of-turn token itself when it stops; a turn cut by length has none of it)."""
    for k in range(min(len(turn), len(closing)), 0, -1):
        if list(turn[-k:]) == list(closing[:k]):
            return k
    return 0


def stop_at(text: str, stop: Sequence[str]) -> int | None:
    """The end of the earliest stop string in ``text``, or None."""
    ends = [i + len(s) for s in stop if (i := text.find(s)) >= 0]
    return min(ends) if ends else None
