"""Preflight knows a vision-language run (`asyncrl launch --dry-run`, one line each): images missing on disk, a
VLM without its processor, an image that leaves no room in the context, images for a text model, a prompt
whose image tokens and images disagree, and what the loop cannot run on a VLM yet (the transformers engine, a
critic)."""

from __future__ import annotations

import json

import pytest
from demo_launch import DEMO, assert_one_line_error, asyncrl
from PIL import Image

PROMPT = "<image>What colour is the shape?\nAnswer: "


@pytest.fixture(scope="module")
def vlm_dir(tiny_vlm_dir):
    return tiny_vlm_dir


def dataset(tmp_path, records: list[dict]) -> str:
    (tmp_path / "images").mkdir(exist_ok=True)
    Image.new("RGB", (64, 64), (255, 0, 0)).save(tmp_path / "images" / "red.png")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def red(prompt: str = PROMPT, images=("images/red.png",)) -> dict:
    return {"prompt": prompt, "images": list(images), "answer": "red"}


def dry_run(model: str, train: str, *sets: str):
    args = ["--set", f"model.path={model}", "--set", "model.recipe=null", "--set", f"data.train={train}"]
    args += ["--set", "data.eval=null", "--set", "generator.engine.type=vllm"]
    for s in sets:
        args += ["--set", s]
    return asyncrl("launch", "--config", str(DEMO), *args, "--dry-run")


def test_a_vlm_run_whose_images_fit_passes(tmp_path, vlm_dir):
    proc = dry_run(vlm_dir, dataset(tmp_path, [red(), red()]))
    assert proc.returncode == 0, proc.stderr


def test_an_image_missing_on_disk(tmp_path, vlm_dir):
    proc = dry_run(vlm_dir, dataset(tmp_path, [red(), red(images=["images/gone.png"]), red(images=["images/x.png"])]))
    assert_one_line_error(proc, "image file not found", "gone.png", "(1 more missing)")


def test_a_launch_with_an_image_missing_stops_before_anything_starts(tmp_path, vlm_dir):
    """Not only --dry-run: a launch names the missing image before it makes its run directory or starts a process
    (before, its learners were already building when the prompt check on its thread found it)."""
    train = dataset(tmp_path, [red(), red(images=["images/gone.png"])])
    out = tmp_path / "runs"
    args = ["--set", f"model.path={vlm_dir}", "--set", "model.recipe=null", "--set", f"data.train={train}"]
    args += ["--set", "data.eval=null", "--set", "generator.engine.type=vllm", "--set", f"run.out_dir={out}"]
    proc = asyncrl("launch", "--config", str(DEMO), *args)
    assert_one_line_error(proc, "image file not found", "gone.png")
    assert proc.returncode == 2 and not out.exists()


def test_a_vlm_without_its_processor(tmp_path, vlm_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (bare / name).write_bytes((vlm_dir / name).read_bytes())
    proc = dry_run(bare, dataset(tmp_path, [red()]))
    assert_one_line_error(proc, "is a vision-language model", "processor")


def test_an_image_too_large_for_the_context(tmp_path, vlm_dir):
    # the prompt is 35 ids with its one image token, 53 with the image's 19 in its place: 53 + 8 > 60, 35 + 8 < 60
    proc = dry_run(vlm_dir, dataset(tmp_path, [red()]), "generator.max_model_len=60", "generator.max_new_tokens=8")
    assert_one_line_error(proc, "train.jsonl:1", "the prompt is 53 tokens", "context of 60 tokens")


def test_images_for_a_text_model(tmp_path, tiny_model_dir):
    proc = dry_run(tiny_model_dir, dataset(tmp_path, [red()]))
    assert_one_line_error(proc, "has records with images", "is not a vision-language model")


def test_image_tokens_and_images_that_disagree(tmp_path, vlm_dir):
    proc = dry_run(vlm_dir, dataset(tmp_path, [red(), red(prompt="What colour?")]))
    assert_one_line_error(proc, "train.jsonl:2", "0 <image> tokens for 1 images")


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("generator.engine.type=hf", "only the vLLM engine serves one"),
        ("algorithm.name=ppo", "needs a critic"),
    ],
)
def test_what_a_vlm_cannot_run_yet(tmp_path, vlm_dir, setting, says):
    proc = dry_run(vlm_dir, dataset(tmp_path, [red()]), setting)
    assert_one_line_error(proc, "is a vision-language model", says)


def test_offline_training_refuses_a_vlm_in_one_line(vlm_dir):
    proc = asyncrl("sft", "--config", "configs/sort-sft.yaml", "--set", f"model.path={vlm_dir}",
                   "--set", "model.recipe=null", "--dry-run")  # fmt: skip
    assert_one_line_error(proc, "is a vision-language model", "asyncrl sft trains text models only")
