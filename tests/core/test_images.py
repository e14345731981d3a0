"""A record's images (asyncrl.data): the record format, bad records, references by path and hash, and the wire
carrying them (asyncrl.protocol, schema version 3)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re

import msgpack
import numpy as np
import pytest
from PIL import Image

from asyncrl.data import ImageRef, images_problem, load_images, load_jsonl, missing_images, refs_of
from asyncrl.errors import UserError
from asyncrl.protocol import ProtocolError, Sample, TrajectoryGroup, decode_group, encode_group


def png(colour=(255, 0, 0), size=(8, 8)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def dataset(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(png())
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "<image>colour?", "images": ["images/a.png"], "answer": "red"}) + "\n")
    return path


def test_a_record_with_images_loads_and_its_files_resolve_against_the_dataset(dataset):
    (record,) = load_jsonl(dataset)
    (ref,) = refs_of(record, dataset.parent)
    assert ref.path == str((dataset.parent / "images" / "a.png").resolve()) and ref.data is None
    assert ref.sha256 == hashlib.sha256(png()).hexdigest()
    (picture,) = load_images([ref])
    assert picture.mode == "RGB" and picture.size == (8, 8) and picture.getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize(
    ("images", "says"),
    [
        ("a.png", "non-empty list"),
        ([], "non-empty list"),
        ([3], "images[0] must be a non-empty string"),
        (["a.png", ""], "images[1] must be a non-empty string"),
        (["data:image/png,abc"], "without ';base64,'"),
    ],
)
def test_a_bad_images_field_is_one_line_naming_file_and_line(tmp_path, images, says):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "x"}) + "\n" + json.dumps({"prompt": "<image>", "images": images}) + "\n")
    with pytest.raises(UserError, match=f"bad.jsonl:2: .*{re.escape(says)}"):
        load_jsonl(path)
    assert images_problem(["a.png"]) is None


def test_missing_files_and_bad_base64_are_named(dataset, tmp_path):
    record = {"prompt": "<image><image>", "images": ["images/a.png", "images/gone.png"]}
    assert missing_images([record, record], dataset.parent) == [str((tmp_path / "images" / "gone.png").resolve())]
    with pytest.raises(UserError, match=r"images\[1\]: image file not found: .*gone.png"):
        refs_of(record, dataset.parent)
    with pytest.raises(UserError, match=r"images\[0\]: not valid base64"):
        refs_of({"prompt": "<image>", "images": ["data:image/png;base64,@@@"]}, dataset.parent)


def test_a_base64_image_travels_inline_and_decodes(tmp_path):
    blob = png((0, 0, 255))
    record = {"prompt": "<image>", "images": ["data:image/png;base64," + base64.b64encode(blob).decode()]}
    (ref,) = refs_of(record, tmp_path)
    assert ref.data == blob and ref.path is None and ref.sha256 == hashlib.sha256(blob).hexdigest()
    assert load_images([ref])[0].getpixel((1, 1)) == (0, 0, 255)
    assert missing_images([record], tmp_path) == []


def test_an_image_changed_on_disk_since_it_was_sampled_is_an_error_not_another_image(dataset):
    (ref,) = refs_of(load_jsonl(dataset)[0], dataset.parent)
    (dataset.parent / "images" / "a.png").write_bytes(png((0, 255, 0)))
    with pytest.raises(ValueError, match="changed since it was sampled"):
        ref.read()
    (dataset.parent / "images" / "a.png").unlink()
    with pytest.raises(ValueError, match="cannot be read"):
        ref.read()


def _group(images: list[ImageRef]) -> TrajectoryGroup:
    sample = Sample(np.array([5, 6], np.int32), np.array([-0.5, -0.25], np.float32), np.array([1, 1], np.int32), 1.0)
    return TrajectoryGroup(np.arange(30, dtype=np.int32), [sample], 3, 0, "gen-0", images=images)


def test_the_wire_carries_image_references_by_path_and_inline_as_version_3(dataset):
    by_path = refs_of(load_jsonl(dataset)[0], dataset.parent)[0]
    inline = ImageRef(hashlib.sha256(b"x").hexdigest(), data=b"x")
    frame = encode_group(_group([by_path, inline]))
    obj = msgpack.unpackb(frame, raw=False)
    assert obj["schema_version"] == 3
    assert obj["images"] == [{"sha256": by_path.sha256, "path": by_path.path}, {"sha256": inline.sha256, "data": b"x"}]
    back = decode_group(frame)
    assert back.images == [by_path, inline] and back.prompt_ids.tolist() == list(range(30))


def test_a_group_without_images_is_still_written_as_version_2():
    obj = msgpack.unpackb(encode_group(_group([])), raw=False)
    assert obj["schema_version"] == 2 and "images" not in obj
    assert decode_group(encode_group(_group([]))).images == []


@pytest.mark.parametrize(
    "images",
    [
        [{"sha256": "ab", "path": "/x.png"}],  # not a 64-digit hash
        [{"sha256": "0" * 64}],  # neither path nor data
        [{"sha256": "0" * 64, "path": "/x.png", "data": b"x"}],  # both
        [{"sha256": "0" * 64, "path": 3}],
        "not a list",
    ],
)
def test_a_frame_with_a_malformed_image_reference_is_refused(images):
    obj = msgpack.unpackb(encode_group(_group([ImageRef("0" * 64, path="/x.png")])), raw=False)
    obj["images"] = images
    with pytest.raises(ProtocolError):
        decode_group(msgpack.packb(obj, use_bin_type=True))
