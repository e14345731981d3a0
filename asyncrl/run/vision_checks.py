"""Preflight of a vision-language run, one line per mistake: what the loop cannot serve (an engine, a preset),
a VLM without its processor, images missing on disk, records with images for a text model, an image that
leaves the prompt no room in the context (``asyncrl.run.preflight.check_prompt_lengths`` counts each image's
tokens through :class:`ImageTokens`)."""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.config import Config
from asyncrl.errors import UserError


def is_vision_dir(model_path: str | None) -> bool:
    """Whether ``model_path``'s ``config.json`` is a vision-language model's (no transformers import)."""
    try:
        return "vision_config" in json.loads((Path(model_path or "") / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def check_vision_run(cfg: Config) -> None:
    """What a vision-language model cannot do in this loop yet, refused before anything starts."""
    if not is_vision_dir(cfg.model.path):
        return
    what = f"model {cfg.model.path} is a vision-language model"
    if cfg.generator.engine.type != "vllm":
        raise UserError(f"{what}: only the vLLM engine serves one (generator.engine.type=vllm)")
    if cfg.algorithm.preset.needs_critic:
        raise UserError(
            f"{what}: algorithm {cfg.algorithm.name} needs a critic, which takes no images yet: use grpo, rloo or "
            "reinforce++"
        )
    if cfg.model.lora is not None:
        raise UserError(f"{what}: model.lora does not train one yet (its targets would reach the vision tower)")


def check_images_exist(dataset: str | Path, records: list[dict]) -> None:
    """Every image file that ``records`` (``dataset``'s) name exists, relative to the dataset's folder; else one
    error naming the first missing and how many more."""
    from asyncrl.data import missing_images

    if missing := missing_images(records, Path(dataset).parent):
        more = f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""
        raise UserError(f"{dataset}: image file not found: {missing[0]}{more}")


class ImageTokens:
    """How many tokens each record's images add to its prompt, for a dataset of records with images."""

    def __init__(self, model_path: str, dataset: str, records: list[dict]):
        self.base_dir = Path(dataset).parent
        check_images_exist(dataset, records)
        if not is_vision_dir(model_path):
            raise UserError(f"{dataset} has records with images, and {model_path} is not a vision-language model")
        from asyncrl.models.vision import VisionInputs

        self.vision = VisionInputs(model_path)  # a UserError when it has no processor
        self._by_size: dict[tuple[int, int], int] = {}

    def extra(self, record: dict) -> int:
        """The record's expanded prompt length minus its unexpanded one (each image token becomes many);
        ``UserError`` for an unreadable image or a placeholder count that differs from the images'."""
        from PIL import Image

        from asyncrl.data import refs_of

        # the expansion depends on the image's size only (the processor resizes), so one per size is made
        extra = 0
        for ref in refs_of(record, self.base_dir):
            try:
                with Image.open(ref.path) if ref.data is None else _inline(ref.data) as img:
                    size, picture = img.size, None if img.size in self._by_size else img.convert("RGB")
            except OSError as exc:
                raise UserError(f"{ref.path or 'an inline image'} is not a readable image: {exc}") from None
            if size not in self._by_size:
                self._by_size[size] = len(self.vision.expand([self.vision.image_token_id], [picture])) - 1
            extra += self._by_size[size]
        return extra

    def placeholder_problem(self, ids: list[int], record: dict) -> str | None:
        n, want = self.vision.placeholders(ids), len(record.get("images") or [])
        if n == want:
            return None
        return f"the prompt has {n} {self.vision.image_token} tokens for {want} images: one goes where each image goes"


def _inline(blob: bytes):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(blob))
