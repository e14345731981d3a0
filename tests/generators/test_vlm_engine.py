"""A vision-language model in the real vLLM engine (the shapes demo's tiny Idefics3, untrained): vLLM expands
each image token as the learner's processor does, its behaviour log-probs are the learner's with the same
pixels, and they stay so across weight versions: the language model alone (the tower frozen), the same image
again after the reload (its cached embedding dropped with the old weights), and every weight at once."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

pytest.importorskip("vllm")

from vllm_common import start_engine  # noqa: E402

from asyncrl.generators.engine import Sampling  # noqa: E402
from asyncrl.generators.vllm_engine import VllmEngine  # noqa: E402
from asyncrl.learners.batching import model_logprobs  # noqa: E402
from asyncrl.models.vision import VisionInputs, causal_lm_class, language_names  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]


@pytest.fixture(scope="module")
def vlm_dir(tiny_vlm_dir):
    return tiny_vlm_dir


@pytest.fixture(scope="module")
def engine(vlm_dir):
    return start_engine(vlm_dir)


def pictures() -> list[Image.Image]:
    return [Image.new("RGB", (64, 64), c) for c in COLOURS]


def sample(engine: VllmEngine, prompt: list[int]) -> dict[int, tuple[list[int], list[float]]]:
    """One temperature-1 completion of ``prompt`` per picture, by picture."""
    for i, img in enumerate(pictures()):
        engine.add_request(f"r{i}", prompt, Sampling(1, 1.0, 1.0, 8), (img,))
    out: dict[int, tuple[list[int], list[float]]] = {i: ([], []) for i in range(len(COLOURS))}
    done = 0
    while done < len(COLOURS):
        for step in engine.step():
            tokens, logprobs = out[int(step.request_id[1:])]
            tokens += step.tokens
            logprobs += step.logprobs
            done += step.finished
    return out


def mismatch(model, vision: VisionInputs, prompt: list[int], sampled) -> float:
    """The largest |log pi - log mu| over every sampled token, pi the learner's forward with the same pixels.
    A completion that sampled the image token is left out: the generator fails such an episode (a perturbed
    random model does sample it), as the learner's forward cannot place it (generators/prompts.py)."""
    worst, compared = 0.0, 0
    for i, img in enumerate(pictures()):
        tokens, behaviour = sampled[i]
        if vision.image_token_id in tokens:
            continue
        compared += 1
        ids = vision.expand(prompt, [img]) + tokens
        x = torch.tensor([ids])
        with torch.no_grad():
            logprobs = model_logprobs(model, x, torch.ones_like(x), 1.0, inputs=vision.pixels([[img]]))[0]
        learner = logprobs[len(ids) - len(tokens) - 1 :]
        worst = max(worst, float((learner - torch.tensor(behaviour)).abs().max()))
    assert compared >= 2
    return worst


def test_vllm_expands_image_tokens_as_the_learner_does(engine, vlm_dir):
    from vllm import SamplingParams

    vision = VisionInputs(str(vlm_dir))
    prompt = vision.processor.tokenizer.encode("<image>What colour is the shape?\nAnswer: ")
    img = pictures()[2]
    (out,) = engine.llm.generate(
        {"prompt_token_ids": prompt, "multi_modal_data": {"image": [img]}}, SamplingParams(max_tokens=1)
    )
    assert list(out.prompt_token_ids) == vision.expand(prompt, [img])


def test_behaviour_logprobs_match_the_learner_across_versions_frozen_tower_and_whole(engine, vlm_dir):
    vision = VisionInputs(str(vlm_dir))
    prompt = vision.processor.tokenizer.encode("<image>What colour is the shape?\nAnswer: ")
    model = causal_lm_class(str(vlm_dir)).from_pretrained(vlm_dir, dtype=torch.float32).eval()
    assert mismatch(model, vision, prompt, sample(engine, prompt)) < 1e-4
    language = language_names(model)
    torch.manual_seed(0)
    with torch.no_grad():  # version 1: the language model moves, the tower stays (freeze_vision)
        for name, p in model.named_parameters():
            if name in language:
                p.add_(0.05 * torch.randn_like(p))
    engine.load_weights({k: v for k, v in model.state_dict().items() if k in language})
    assert mismatch(model, vision, prompt, sample(engine, prompt)) < 1e-4  # the same images again
    with torch.no_grad():  # version 2: everything moves (freeze_vision: false)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.load_weights(dict(model.state_dict()))
    assert mismatch(model, vision, prompt, sample(engine, prompt)) < 1e-4
