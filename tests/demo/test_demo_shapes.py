"""The vision demo task (name a shape's colour), its shipped data and drawn images, and the demo-shapes model
recipe (a tiny Idefics3 with its processor)."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.demo import shapes

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "shapes"


def _load(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def _small_dataset(directory: Path, n: int = 12) -> Path:
    """The first ``n`` held-out records as a dataset file of their own (its images not drawn yet)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _load("eval.jsonl")[:n]))
    return path


# --- reward --------------------------------------------------------------------------------------

REC = shapes.make_record(random.Random(0))


@pytest.mark.parametrize("completion", [REC["answer"], f" {REC['answer']}\n", REC["answer"].capitalize()])
def test_reward_is_one_for_the_right_colour(completion):
    assert shapes.reward(REC["prompt"], completion, REC) == 1.0
    assert shapes.exact(completion, REC)


@pytest.mark.parametrize("wrong", ["", " ", "re", "reds", "red.", "red square", "the red one", "purple"])
def test_reward_is_zero_for_anything_but_the_word(wrong):
    rec = {**REC, "answer": "red"}
    assert shapes.reward(rec["prompt"], wrong, rec) == 0.0
    assert not shapes.exact(wrong, rec)


@given(st.text(alphabet="redgrnbluyowRGB \n.", max_size=12), st.integers(0, 10_000))
def test_reward_is_one_exactly_when_exact_else_zero(completion, seed):
    rec = shapes.make_record(random.Random(seed))
    r = shapes.reward(rec["prompt"], completion, rec)
    assert r in (0.0, 1.0)
    assert (r == 1.0) == shapes.exact(completion, rec)


def test_the_warm_ups_wrong_colour_is_a_cycle_parting_at_the_first_byte():
    assert sorted(shapes.COLOUR_CYCLE) == sorted(shapes.COLOURS)
    seen, colour = [], "red"
    for _ in shapes.COLOUR_CYCLE:
        seen.append(colour)
        colour = shapes.next_colour(colour)
    assert colour == "red" and sorted(seen) == sorted(shapes.COLOURS)
    assert len({c[0] for c in shapes.COLOURS}) == len(shapes.COLOURS)  # the two modes differ at token 1


# --- data ----------------------------------------------------------------------------------------


def test_data_files_are_well_formed_disjoint_and_reproducible():
    train, held_out = _load("train.jsonl"), _load("eval.jsonl")
    assert (len(train), len(held_out)) == (shapes.N_TRAIN, shapes.N_EVAL)
    for rec in train + held_out:
        assert set(rec) == {"prompt", "images", "answer", "shape"}
        assert rec["prompt"] == shapes.PROMPT and rec["prompt"].count(shapes.IMAGE_TOKEN) == len(rec["images"]) == 1
        s = rec["shape"]
        assert rec["answer"] == s["colour"] in shapes.COLOURS and s["kind"] in shapes.KINDS
        assert shapes.MIN_SIZE <= s["size"] <= shapes.MAX_SIZE
        assert 0 <= s["x"] <= shapes.IMAGE_SIZE - s["size"] and 0 <= s["y"] <= shapes.IMAGE_SIZE - s["size"]
        assert rec["images"] == [shapes.image_name(s)] and not Path(rec["images"][0]).is_absolute()
    train_images = {r["images"][0] for r in train}
    assert len(train_images) == len(train)
    assert not train_images & {r["images"][0] for r in held_out}
    assert (train, held_out) == shapes.make_splits(shapes.N_TRAIN, shapes.N_EVAL, shapes.DATA_SEED)
    assert shapes.make_splits(10, shapes.N_EVAL, shapes.DATA_SEED)[1] == held_out  # eval independent of n_train
    assert {r["answer"] for r in held_out} == set(shapes.COLOURS)
    assert sum((DATA / f).stat().st_size for f in shapes.SPLIT_FILES) < 500_000


def test_the_images_folder_is_ignored_by_git():
    assert "data/shapes/images/" in (ROOT / ".gitignore").read_text().splitlines()


# --- images --------------------------------------------------------------------------------------


def test_ensure_images_writes_only_missing_files_with_the_same_bytes(tmp_path):
    first = _small_dataset(tmp_path / "a")
    assert shapes.ensure_images(first) == 12
    assert shapes.ensure_images(first) == 0
    names = [r["images"][0] for r in _load("eval.jsonl")[:12]]
    victim = first.parent / names[3]
    victim.unlink()
    assert shapes.ensure_images(first) == 1 and victim.is_file()
    second = _small_dataset(tmp_path / "b")
    assert shapes.ensure_images(second) == 12
    for name in names:
        assert (first.parent / name).read_bytes() == (second.parent / name).read_bytes()
    assert not [p for p in (first.parent / "images").iterdir() if p.name.startswith(".")]  # no temp file left


def test_images_are_64px_rgb_black_with_exactly_the_shapes_colour(tmp_path):
    import numpy as np
    from PIL import Image

    path = _small_dataset(tmp_path, n=24)
    shapes.ensure_images(path)
    for rec in _load("eval.jsonl")[:24]:
        with Image.open(path.parent / rec["images"][0]) as img:
            assert (img.mode, img.size) == ("RGB", (shapes.IMAGE_SIZE, shapes.IMAGE_SIZE))
            pixels = np.asarray(img)
        colours = {tuple(int(v) for v in p) for p in np.unique(pixels.reshape(-1, 3), axis=0)}
        assert colours == {(0, 0, 0), shapes.COLOURS[rec["answer"]]}
        s = rec["shape"]
        drawn = np.argwhere(pixels.any(-1))  # (row, column) of every coloured pixel
        assert drawn.min(0).tolist() >= [s["y"], s["x"]]
        assert drawn.max(0).tolist() <= [s["y"] + s["size"] - 1, s["x"] + s["size"] - 1]
        assert len(drawn) >= s["size"] ** 2 / 4  # a triangle fills about half its box


def test_concurrent_ensure_images_leave_whole_identical_files(tmp_path):
    path = _small_dataset(tmp_path / "race", n=40)
    counts: list[int] = []
    threads = [threading.Thread(target=lambda: counts.append(shapes.ensure_images(path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 40 <= sum(counts) and len(counts) == 4
    reference = _small_dataset(tmp_path / "ref", n=40)
    shapes.ensure_images(reference)
    for rel in sorted(p.name for p in (reference.parent / "images").iterdir()):
        assert (path.parent / "images" / rel).read_bytes() == (reference.parent / "images" / rel).read_bytes()
    assert len(list((path.parent / "images").iterdir())) == 40  # no temp file left


# --- processor and model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def processor():
    from asyncrl.demo.vlm import build_processor

    return build_processor()


def test_tokenizer_adds_nothing_and_one_image_token_expands_to_19_ids(processor):
    from asyncrl.demo.vlm import IMAGE_EXPANSION, IMAGE_SEQ_LEN

    tok = processor.tokenizer
    text = shapes.PROMPT + "red"
    ids = tok.encode(text)
    assert ids == tok.encode(text, add_special_tokens=True) == tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids("<image>")) == 1 and len(ids) == len(text.encode()) - 6
    assert tok.decode(ids) == text
    out = processor(text=[shapes.PROMPT], images=[shapes.record_images(REC)])
    expanded = out["input_ids"][0]
    assert expanded == tok.convert_tokens_to_ids(IMAGE_EXPANSION) + ids[1:-3]
    assert len(IMAGE_EXPANSION) == IMAGE_SEQ_LEN + 3 == 19
    assert len(set(tok.convert_tokens_to_ids(IMAGE_EXPANSION))) == 3  # <fake_token_around_image> <global-img> <image>


def test_a_build_saves_and_reloads_with_auto_classes_and_the_same_logits(tmp_path, processor):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from asyncrl.demo import recipes, vlm

    torch.set_num_threads(1)
    model, tokenizer, proc, record = vlm.build_shapes(seed=0, log=lambda _: None, steps=2, see_rounds=0)
    assert record["recipe"] == "demo-shapes" and record["sft_steps"] == 2
    assert {"eval_reward", "eval_exact", "sample_reward", "eval_records", "sft_seconds"} <= set(record)
    path = tmp_path / "shapes"
    recipes._publish(path, model, tokenizer, record, proc)
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"

    loaded_proc = AutoProcessor.from_pretrained(path)
    loaded = AutoModelForImageTextToText.from_pretrained(path).eval()
    config = loaded.config
    assert config.text_config.head_dim >= 32  # vLLM's CPU attention refuses head_dim 16
    assert config.image_token_id == loaded_proc.tokenizer.convert_tokens_to_ids("<image>")
    assert config.text_config.max_position_embeddings == vlm.MAX_POSITIONS

    records = _load("eval.jsonl")[:6]
    before, after = vlm.encode(proc, records), vlm.encode(loaded_proc, records)
    assert before.prompt_ids == after.prompt_ids and torch.equal(before.pixel_values, after.pixel_values)
    inputs = dict(
        input_ids=torch.tensor(after.prompt_ids),
        pixel_values=after.pixel_values,
        pixel_attention_mask=after.pixel_attention_mask,
    )
    with torch.no_grad():
        assert torch.equal(model.eval()(**inputs).logits, loaded(**inputs).logits)


def test_fresh_models_are_deterministic_for_a_seed(processor):
    import torch

    from asyncrl.demo.vlm import build_vlm

    a, b, c = (build_vlm(processor.tokenizer, seed=s).state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_a_launch_from_another_working_directory_draws_beside_the_dataset_its_config_names(tmp_path):
    """`asyncrl prepare-demo` (the launch's preflight) with the config's relative ``data/shapes/*.jsonl`` read from
    another working directory: the images go beside THOSE files, none into the package's own tree."""
    import subprocess
    import sys

    import yaml

    cwd = tmp_path / "elsewhere"
    records = [shapes.make_record(random.Random(900_000 + i)) for i in range(6)]
    records = [r for r in records if not (DATA / r["images"][0]).exists()]  # names the package's tree lacks
    assert records
    (cwd / "data" / "shapes").mkdir(parents=True)
    for name in shapes.SPLIT_FILES:
        (cwd / "data" / "shapes" / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    model = tmp_path / "model"  # a model already there: only the data is prepared
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = yaml.safe_load((ROOT / "configs" / "demo-shapes.yaml").read_text())
    cfg["model"]["path"] = str(model)
    (tmp_path / "shapes.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "asyncrl.cli", "prepare-demo", "--config", str(tmp_path / "shapes.yaml")]
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"drew {len(records)} missing images under data/shapes/images" in out.stdout
    for r in records:
        assert (cwd / "data" / "shapes" / r["images"][0]).is_file()
        assert not (DATA / r["images"][0]).exists()


def test_ensure_images_leaves_records_of_other_tasks_alone(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "<image>?", "images": ["theirs.png"], "answer": "x"}) + "\n")
    assert shapes.ensure_images(path) == 0 and not (tmp_path / "theirs.png").exists()


# --- the demo model recipe -----------------------------------------------------------------------


@pytest.mark.slow
def test_prepare_demo_model_builds_a_partial_policy_that_sees_colours():
    """The full warm-up (about a minute on 2 cores), into the repository's model cache where the launch
    (tests/e2e/test_vlm_launch.py) then finds it: greedy takes the wrong mode, a share of temperature-1
    samples is right, and nearly every sample names the right colour or the wrong mode's, so the frozen tower
    carries what RL needs."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from asyncrl.config.model import RECIPE_PATHS
    from asyncrl.demo import vlm
    from asyncrl.demo.model import RECIPE_FILE
    from asyncrl.demo.recipes import prepare_demo_model

    torch.set_num_threads(2)
    path = ROOT / RECIPE_PATHS["demo-shapes"]
    assert prepare_demo_model(path, seed=0, log=lambda _: None, recipe="demo-shapes") == path
    recipe = json.loads((path / RECIPE_FILE).read_text())
    assert recipe["recipe"] == "demo-shapes" and recipe["seed"] == 0
    assert recipe["eval_exact"] <= 0.3  # partial: RL has to do the rest (the demo needs <= 0.4)
    assert 0.2 <= recipe["sample_reward"] <= 0.45
    assert recipe["sample_seen"] >= 0.9
    assert recipe["train_colour_mass"] >= vlm.SEE_BAR  # the recipe's own check (1 torch thread needs a round more)
    assert not list(path.parent.glob(f".{path.name}.tmp-*"))  # no temp dir left behind
    assert all((DATA / r["images"][0]).is_file() for r in _load("eval.jsonl") + _load("train.jsonl"))

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    scores = vlm.greedy_eval(model, processor.tokenizer, vlm.encode(processor, _load("eval.jsonl")))
    assert scores["exact_rate"] == pytest.approx(recipe["eval_exact"], abs=1e-6)

    logs: list[str] = []
    assert prepare_demo_model(path, seed=0, log=logs.append, recipe="demo-shapes") == path  # cached
    assert len(logs) == 1 and "cached" in logs[0]
