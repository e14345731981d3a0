"""Vision-language models: which HF class loads one, which of its weights are the language model's, and its
processor's two jobs for the loop (expanding each image placeholder of a prompt, making the pixel inputs).

A VLM is a model whose config has a ``vision_config`` (Idefics3/SmolVLM, Qwen2-VL, LLaVA, ...). Its weights
split in two: the language model's (the decoder and the LM head) and the vision side's (the vision tower and
the connector or projector that maps its features into the decoder's width). ``model.freeze_vision`` keeps
the vision side as loaded: the learner gives it no gradient and each weight version carries only the language
model's tensors, which vLLM reloads in place (a partial reload; the engine keeps the tower it has).

Prompt ids and the engines: a prompt holds ONE image token per image (the processor's ``image_token``, e.g.
``<image>``); vLLM expands each itself from the image it gets beside the ids (ids already expanded would be
expanded again). The learner needs the expanded ids: :meth:`VisionInputs.expand` makes them with the same
processor, one image at a time, so both agree token for token (tests/models/test_vision.py checks it against
vLLM's own expansion).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncrl.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn


def is_vision_config(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def is_vision_model(path: str) -> bool:
    """Whether the model at ``path`` (an HF directory) is a vision-language model."""
    from transformers import AutoConfig

    return is_vision_config(AutoConfig.from_pretrained(path))


def causal_lm_class(path: str):
    """The transformers Auto class that loads ``path`` with its LM head: image-text-to-text for a VLM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_model(path) else AutoModelForCausalLM


def language_names(model: nn.Module) -> set[str]:
    """The parameter names (as ``model.named_parameters()`` gives them) of the language model: the decoder
    (``get_decoder()``) and the output embeddings. For a text-only model: every parameter."""
    if not is_vision_config(getattr(model, "config", None)):
        return {name for name, _ in model.named_parameters()}
    parts = [model.get_decoder(), model.get_output_embeddings()]
    owned = {id(p) for part in parts for p in part.parameters()}
    return {name for name, p in model.named_parameters() if id(p) in owned}


def freeze_vision(model: nn.Module) -> int:
    """Turn off the gradient of every parameter outside the language model; returns how many tensors."""
    language = language_names(model)
    frozen = [p for name, p in model.named_parameters() if name not in language]
    for p in frozen:
        p.requires_grad_(False)
    return len(frozen)


@contextlib.contextmanager
def quiet_config_repr():
    """transformers' warnings off (errors stay) while it loads a config: it builds the class's DEFAULT config to
    print a loaded one's differences, and Idefics3's default warns that its pad id 128002 is outside its vocabulary
    of 32000: about no model of ours, on the line where a one-line error is expected."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


class VisionInputs:
    """A VLM's processor, loaded from the model's directory (``UserError`` when it has none)."""

    def __init__(self, path: str):
        from transformers import AutoProcessor

        try:
            with quiet_config_repr():
                self.processor = AutoProcessor.from_pretrained(path)
        except (OSError, ValueError, TypeError) as exc:
            raise UserError(f"{path} is a vision-language model but its processor does not load: {exc}") from None
        token = getattr(self.processor, "image_token", None)
        if not isinstance(token, str) or getattr(self.processor, "image_processor", None) is None:
            raise UserError(
                f"{path} is a vision-language model without an image processor (no preprocessor_config.json "
                "or processor_config.json): save the model's processor in its directory"
            )
        self.image_token = token
        self.image_token_id = int(self.processor.tokenizer.convert_tokens_to_ids(token))

    def placeholders(self, ids: Sequence[int]) -> int:
        return sum(1 for t in ids if t == self.image_token_id)

    def expand(self, ids: Sequence[int], images: Sequence) -> list[int]:
        """``ids`` with its i-th image token replaced by the processor's tokens for ``images[i]``;
        ``ValueError`` when the counts differ."""
        if self.placeholders(ids) != len(images):
            raise ValueError(
                f"the prompt has {self.placeholders(ids)} {self.image_token} tokens and the record "
                f"{len(images)} images: put one {self.image_token} where each image goes"
            )
        out, pending = [], iter(images)
        for t in ids:
            out.extend(self._tokens_of(next(pending)) if t == self.image_token_id else (t,))
        return out

    def _tokens_of(self, image) -> list[int]:
        encoded = self.processor(text=[self.image_token], images=[[image]], add_special_tokens=False)
        return [int(t) for t in encoded["input_ids"][0]]

    def pixels(self, rows: Sequence[Sequence]) -> dict[str, torch.Tensor]:
        """The model's pixel inputs for a batch whose row ``i`` shows ``rows[i]`` (every row at least one
        image; rows with fewer than the most are padded as the image processor pads them)."""
        return dict(self.processor.image_processor([list(r) for r in rows], return_tensors="pt"))
