"""A vision-language policy in the learner: each batch row's pixel inputs, and the names a version carries.

Every sample of a group shows the group's images (its prompt's); row ``i`` of a batch gets them through the
model's own image processor (:class:`asyncrl.models.vision.VisionInputs`), padded across rows as that
processor pads (Idefics3: all-zero images, which the model drops). The prompt ids on the wire are already
expanded, so the image tokens sit in the prompt: context, never scored, no gradient into their logits.
Decoded images are kept by content hash (``CACHE_IMAGES``): a prompt comes back every epoch.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from asyncrl.data import ImageRef, decode_image
from asyncrl.errors import UserError
from asyncrl.learners.models import IMAGE_PREFIX
from asyncrl.models.vision import VisionInputs, is_vision_model, language_names

if TYPE_CHECKING:
    import torch

    from asyncrl.config import ModelConfig
    from asyncrl.protocol import TrajectoryGroup

CACHE_IMAGES = 4096  # decoded images kept: a demo's whole set; a few hundred MB of large photos at most


class BatchImages:
    def __init__(self, model_path: str):
        self.vision = VisionInputs(model_path)
        self._decoded: OrderedDict[str, object] = OrderedDict()

    def inputs(self, groups: list[TrajectoryGroup]) -> dict[str, torch.Tensor]:
        """The model's pixel inputs for the batch of ``groups`` (rows: every sample of each, in order);
        ``{}`` when no group has images. Each tensor has a row per sample, so mini-batches slice it; keys are
        the forward's keywords under ``IMAGE_PREFIX`` (``learners.models.image_inputs``)."""
        import torch

        shown = [self._pictures(g.images) for g in groups]
        if not any(shown):
            return {}
        inputs = self.vision.pixels(shown)  # once per group: its samples all show the same images
        if any(v.shape[0] != len(shown) for v in inputs.values()):
            shapes = {k: tuple(v.shape) for k, v in inputs.items()}
            raise UserError(f"this model's image processor does not give one row per prompt ({shapes}): not supported")
        samples = torch.tensor([len(g.samples) for g in groups])
        return {IMAGE_PREFIX + k: v.repeat_interleave(samples, dim=0) for k, v in inputs.items()}

    def _pictures(self, refs: list[ImageRef]) -> list:
        pictures = []
        for ref in refs:
            if ref.sha256 not in self._decoded:
                try:
                    self._decoded[ref.sha256] = decode_image(ref.read())
                except ValueError as exc:
                    raise UserError(f"a trajectory's image: {exc}") from None
                if len(self._decoded) > CACHE_IMAGES:
                    self._decoded.popitem(last=False)
            self._decoded.move_to_end(ref.sha256)
            pictures.append(self._decoded[ref.sha256])
        return pictures


def batch_images(model_path: str) -> BatchImages | None:
    """The batch's image inputs for a vision-language policy; None for a text one."""
    return BatchImages(model_path) if is_vision_model(model_path) else None


def published_names(model, model_cfg: ModelConfig) -> set[str] | None:
    """The names each weight version carries: a vision-language model with ``freeze_vision``, its language
    model's (the engines keep the vision side they loaded); else None, every weight."""
    hf = getattr(model, "module", model)
    if not (model_cfg.freeze_vision and is_vision_model(model_cfg.path)):
        return None
    return language_names(hf)
