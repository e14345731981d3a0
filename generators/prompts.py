"""A dataset record's prompt as the engines take it and as the learner takes it.

For a text prompt the two are the same ids. For a record with ``images`` (:mod:`asyncrl.data`) the engine
takes the ids with ONE image token per image plus the images themselves (vLLM expands each token from its
image), and the learner the processor's expanded ids plus the images' references
(:class:`asyncrl.models.vision.VisionInputs`); the context a prompt uses, and so whether it fits, is the
expanded one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from asyncrl.chat import ChatTokens
from asyncrl.data import ImageRef, load_images, prompt_of, refs_of
from asyncrl.episodes.api import Context, Outcome
from asyncrl.errors import UserError
from asyncrl.models.vision import VisionInputs, is_vision_model
from asyncrl.protocol import Sample, TrajectoryGroup


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: list[int]  # the engine's: one image token per image
    images: tuple = ()  # RGB PIL images in prompt order: the engine's multi-modal input
    refs: tuple[ImageRef, ...] = ()  # the same images as the wire carries them
    expanded: list[int] | None = None  # the learner's ids, each image's tokens in place; None: ``ids``
    image_token: int | None = None  # a vision-language model's image token id (None: a text model)

    @property
    def learner_ids(self) -> list[int]:
        return self.ids if self.expanded is None else self.expanded

    def checked(self, ctx: Context, outcome: Outcome) -> Outcome:
        """``outcome``, or a failed one (cause ``image_token``) when a turn after the prompt holds the image token
        (sampled by the model, or in an environment's reply): vLLM embeds it there as text, while the learner's
        forward takes every image token for an image's slot and fails on a count that does not match the images.
        Rare for a trained model; such an episode is never trained on."""
        if self.image_token is None or outcome.cause is not None or self.image_token not in ctx.tokens:
            return outcome
        return Outcome(None, "image_token", "a turn holds the image token, and there is no image to show there")

    def group(self, samples: list[Sample], prompt_index: int, epoch: int, producer: str) -> TrajectoryGroup:
        """The trajectory group of this prompt's ``samples``: the learner's ids, and the images by reference."""
        ids = np.asarray(self.learner_ids, np.int32)
        return TrajectoryGroup(ids, samples, prompt_index, epoch, producer, images=list(self.refs))


class Prompts:
    """Records of one source -> :class:`Prompt`; image paths are relative to ``base_dir`` (the source's directory)."""

    def __init__(self, chat: ChatTokens, vision: VisionInputs | None, base_dir: str | Path):
        self.chat, self.vision, self.base_dir = chat, vision, Path(base_dir)

    def __call__(self, record: dict) -> Prompt:
        ids = self.chat.prompt_ids(prompt_of(record))
        image_token = self.vision.image_token_id if self.vision is not None else None
        if not record.get("images"):
            return Prompt(ids, image_token=image_token)
        if self.vision is None:
            raise UserError("a record has images and the model is not a vision-language model")
        refs = tuple(refs_of(record, self.base_dir))
        pictures = tuple(load_images(list(refs)))
        try:
            expanded = self.vision.expand(ids, pictures)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        return Prompt(ids, pictures, refs, expanded, image_token)


def vision_for(images: bool, model_path: str) -> VisionInputs | None:
    """The model's processor when any record has ``images`` (None otherwise: a text run never loads it);
    ``UserError`` for images given to a text-only model."""
    if not images:
        return None
    if not is_vision_model(model_path):
        raise UserError(f"the dataset's records have images, and {model_path} is not a vision-language model")
    return VisionInputs(model_path)
