"""A record's prompt as the engine and the learner take it (generators.prompts): one image token per image and
the pictures for the engine, the expanded ids and image references for the learner; a text record unchanged;
an episode whose turns hold the image token failed, never pushed (the learner's forward could not place it)."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from PIL import Image

from asyncrl.chat import ChatTokens
from asyncrl.episodes.api import Outcome
from asyncrl.errors import UserError
from asyncrl.generators.prompts import Prompt, Prompts, vision_for
from asyncrl.protocol import Sample

PROMPT = "<image>What colour is the shape?\nAnswer: "


@pytest.fixture
def dataset(tmp_path):
    (tmp_path / "images").mkdir()
    Image.new("RGB", (64, 64), (0, 0, 255)).save(tmp_path / "images" / "blue.png")
    records = [{"prompt": PROMPT, "images": ["images/blue.png"], "answer": "blue"}, {"prompt": "no picture"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, records


@pytest.fixture
def prompts(dataset, tiny_vlm_dir):
    path, records = dataset
    vision = vision_for(records, str(tiny_vlm_dir))
    return Prompts(ChatTokens(vision.processor.tokenizer), vision, path)


def test_a_record_with_an_image_is_one_token_for_the_engine_and_expanded_for_the_learner(prompts, dataset):
    _, (with_image, text) = dataset
    prompt = prompts(with_image)
    image = prompts.vision.image_token_id
    assert prompt.ids.count(image) == 1 and len(prompt.images) == 1 and prompt.images[0].getpixel((0, 0)) == (0, 0, 255)
    assert prompt.learner_ids.count(image) == 16 and len(prompt.learner_ids) == len(prompt.ids) + 18
    sample = Sample(np.array([98, 258], np.int32), np.zeros(2, np.float32), np.zeros(2, np.int32), 1.0)
    group = prompt.group([sample], 0, 0, "gen-0")
    assert group.prompt_ids.tolist() == prompt.learner_ids and group.images == list(prompt.refs)
    plain = prompts(text)
    assert plain.learner_ids == plain.ids and plain.images == () and plain.image_token == image


def test_an_episode_whose_turns_hold_the_image_token_fails(prompts, dataset):
    prompt, ok = prompts(dataset[1][0]), Outcome({"reward": 1.0})
    image = prompts.vision.image_token_id
    assert prompt.checked(types.SimpleNamespace(tokens=[98, 258]), ok) is ok
    failed = prompt.checked(types.SimpleNamespace(tokens=[98, image, 258]), ok)
    assert failed.status == "image_token" and failed.reward is None
    assert Prompt([1, 2]).checked(types.SimpleNamespace(tokens=[image]), ok) is ok  # a text model's id 260 is text


def test_images_for_a_text_model_and_placeholders_that_disagree_are_user_errors(dataset, tiny_model_dir, prompts):
    _, records = dataset
    with pytest.raises(UserError, match="not a vision-language model"):
        vision_for(records, str(tiny_model_dir))
    assert vision_for([records[1]], str(tiny_model_dir)) is None  # no images: the processor is never loaded
    with pytest.raises(UserError, match="0 <image> tokens and the record 1 images"):
        prompts({"prompt": "What colour?", "images": ["images/blue.png"]})
