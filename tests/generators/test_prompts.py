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
from asyncrl.data import has_images
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
    vision = vision_for(has_images(records), str(tiny_vlm_dir))
    return Prompts(ChatTokens(vision.processor.tokenizer), vision, path.parent)


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
        vision_for(has_images(records), str(tiny_model_dir))
    assert vision_for(has_images([records[1]]), str(tiny_model_dir)) is None  # no images: the processor is never loaded
    with pytest.raises(UserError, match="0 <image> tokens and the record 1 images"):
        prompts({"prompt": "What colour?", "images": ["images/blue.png"]})


# SmolVLM-Instruct's chat template (Idefics3): a message's content is a list of text and image parts
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def test_chat_messages_with_image_parts_render_through_a_vlm_chat_template(tmp_path, tiny_vlm_dir, dataset):
    """A real VLM checkpoint's template (SmolVLM's) takes messages whose content is a list of text and image
    parts; an image part renders as the image token, where the record's next image goes."""
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path / "templated"
    shutil.copytree(tiny_vlm_dir, model)
    (model / "chat_template.jinja").write_text(SMOLVLM_TEMPLATE)
    vision = vision_for(True, str(model))
    chat = ChatTokens(AutoTokenizer.from_pretrained(model))
    assert chat.templated
    record = {
        "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
        "images": ["images/blue.png"],
    }
    prompt = Prompts(chat, vision, dataset[0].parent)(record)
    assert chat.tok.decode(prompt.ids) == "<|im_start|>User:<image>What colour?<end_of_utterance>\nAssistant:"
    assert prompt.ids.count(vision.image_token_id) == 1 and prompt.learner_ids.count(vision.image_token_id) == 16
    # a template that renders contents only as parts takes every string content as one text part: plain prompts,
    # the turn's end, an environment's reply
    assert chat.tok.decode(chat.prompt_ids("Hi?")) == "<|im_start|>User: Hi?<end_of_utterance>\nAssistant:"
    assert chat.tok.convert_tokens_to_ids("<end_of_utterance>") in chat.stop_token_ids
    reply = chat.response_ids("red")
    assert (
        chat.tok.decode(chat.observation_ids("again", "user", after=reply))
        == "\nUser: again<end_of_utterance>\nAssistant:"
    )
