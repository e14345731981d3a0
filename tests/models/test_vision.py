"""A vision-language policy in the loop (asyncrl.models.vision, learners.vision): the processor's expansion of
image tokens, the pixels of a batch, the frozen vision tower and the names each version carries, and image
tokens getting no gradient. The tiny Idefics3 of the shapes demo (asyncrl.demo.vlm), untrained."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from asyncrl.config import ModelConfig
from asyncrl.config.presets import get_preset
from asyncrl.errors import UserError
from asyncrl.learners.batching import make_batch, model_logprobs
from asyncrl.learners.models import image_inputs
from asyncrl.learners.vision import BatchImages, published_names
from asyncrl.models.vision import VisionInputs, causal_lm_class, freeze_vision, language_names
from asyncrl.protocol import Sample, TrajectoryGroup

RED, BLUE = (255, 0, 0), (0, 0, 255)


@pytest.fixture(scope="module")
def vlm_dir(tiny_vlm_dir):
    return tiny_vlm_dir


@pytest.fixture(scope="module")
def vision(vlm_dir):
    return VisionInputs(str(vlm_dir))


def picture(colour) -> Image.Image:
    return Image.new("RGB", (64, 64), colour)


def test_expansion_is_the_processors_own_for_the_whole_prompt(vision):
    tok = vision.processor.tokenizer
    text = "<image>left, <image>right?"
    ids = tok.encode(text)
    assert vision.placeholders(ids) == 2
    expanded = vision.expand(ids, [picture(RED), picture(BLUE)])
    whole = vision.processor(text=[text], images=[[picture(RED), picture(BLUE)]], add_special_tokens=False)
    assert expanded == list(whole["input_ids"][0])
    assert expanded.count(vision.image_token_id) == 2 * 16  # 16 tokens an image (the demo's image_seq_len)
    with pytest.raises(ValueError, match="2 <image> tokens and the record 1 images"):
        vision.expand(ids, [picture(RED)])


def test_a_vlm_directory_without_its_processor_is_one_line(vlm_dir, tmp_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((vlm_dir / name).read_bytes())
    with pytest.raises(UserError, match="vision-language model") as err:
        VisionInputs(str(tmp_path))
    assert "\n" not in str(err.value)


def _group(vision, colours, rewards, response=(70, 71, 258)) -> TrajectoryGroup:
    """A group whose prompt shows ``colours`` (files not needed: BatchImages is fed decoded pictures)."""
    tok = vision.processor.tokenizer
    ids = vision.expand(tok.encode("<image>" * len(colours) + "colour?"), [picture(c) for c in colours])
    n = len(response)
    samples = [
        Sample(np.array(response, np.int32), np.full(n, -1.0, np.float32), np.zeros(n, np.int32), r) for r in rewards
    ]
    return TrajectoryGroup(np.array(ids, np.int32), samples, 0, 0, "gen", images=[_ref(c) for c in colours])


def _ref(colour):
    import hashlib
    import io

    from asyncrl.data import ImageRef

    out = io.BytesIO()
    picture(colour).save(out, format="PNG")
    return ImageRef(hashlib.sha256(out.getvalue()).hexdigest(), data=out.getvalue())


@pytest.fixture(scope="module")
def batch(vlm_dir, vision):
    groups = [_group(vision, [RED], [1.0, 0.0]), _group(vision, [BLUE, RED], [0.0, 1.0])]
    return make_batch(groups, 8, get_preset("grpo"), 256, 0, BatchImages(str(vlm_dir)))


def test_each_row_of_a_batch_shows_its_groups_images(batch, vision):
    pixels = image_inputs(batch)
    assert set(pixels) == {"pixel_values", "pixel_attention_mask"}
    assert pixels["pixel_values"].shape[:2] == (4, 2)  # 4 samples; the most images of a row is 2
    assert not pixels["pixel_attention_mask"][:2, 1].any()  # the first group's rows: one image, the second padding
    assert pixels["pixel_attention_mask"][2:].all()


def test_image_tokens_are_context_no_score_and_no_gradient_and_a_frozen_tower_none(vlm_dir, batch, vision):
    model = causal_lm_class(str(vlm_dir)).from_pretrained(vlm_dir)
    assert freeze_vision(model) > 0
    logits = []

    def keep(_module, _args, out) -> None:
        out.retain_grad()
        logits.append(out)

    model.lm_head.register_forward_hook(keep)
    ids, mask, scored = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    logprobs = model_logprobs(model, ids, mask, 1.0, scored, inputs=image_inputs(batch))
    predicts_image = ids[:, 1:] == vision.image_token_id
    assert predicts_image.any() and not scored[predicts_image].any()
    assert (logprobs[predicts_image] == 0).all()
    logprobs.sum().backward()
    grad = logits[0].grad[:, :-1]  # position j predicts token j + 1
    assert grad[predicts_image].abs().max() == 0 and grad[scored.bool()].abs().max() > 0
    language = language_names(model)
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (name in language), name


def test_a_version_carries_the_language_model_alone_while_the_tower_is_frozen(vlm_dir):
    model = causal_lm_class(str(vlm_dir)).from_pretrained(vlm_dir)
    names = {n for n, _ in model.named_parameters()}
    frozen = published_names(model, ModelConfig(path=str(vlm_dir), freeze_vision=True))
    assert frozen == language_names(model) and frozen < names
    assert all(n.startswith(("model.text_model.", "lm_head.")) for n in frozen)
    assert any(n.startswith("model.vision_model.") for n in names - frozen)
    assert any(n.startswith("model.connector.") for n in names - frozen)
    assert published_names(model, ModelConfig(path=str(vlm_dir), freeze_vision=False)) is None  # every weight


def test_mini_batches_slice_the_image_inputs_by_row(batch):
    rows = torch.tensor([1, 3])
    sub = {k: v[rows] for k, v in batch.items() if k.startswith("image/")}
    assert torch.equal(sub["image/pixel_values"], batch["image/pixel_values"][rows])
