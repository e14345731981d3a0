"""The trajectory wire format (``asyncrl/protocol.py``): round trips, and rejection of bad frames.

A bad frame must raise :class:`ProtocolError` (the learner dead-letters it) and nothing else: any
other exception would crash the learner that read it.
"""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from asyncrl.protocol import (
    TRAJ_SCHEMA_VERSION,
    ProtocolError,
    Sample,
    TrajectoryGroup,
    decode_group,
    encode_group,
    pack_array,
    unpack_array,
)

# ----- strategies -------------------------------------------------------------------------------

_text = st.text(max_size=20)


def _ints(n: int, hi: int) -> st.SearchStrategy[np.ndarray]:
    return st.lists(st.integers(0, hi), min_size=n, max_size=n).map(lambda x: np.array(x, np.int32))


@st.composite
def samples(draw) -> Sample:
    """Model tokens with environment tokens (mask 0, version -1, log-prob 0) anywhere but everywhere."""
    t = draw(st.integers(1, 12))
    logprobs = np.array(draw(st.lists(st.floats(-1e4, 0.0, width=32), min_size=t, max_size=t)), np.float32)
    mask = np.array(draw(st.lists(st.sampled_from([0, 1]), min_size=t, max_size=t)), np.uint8)
    mask[draw(st.integers(0, t - 1))] = 1  # at least one model token
    versions = np.where(mask == 1, draw(_ints(t, 10_000)), -1).astype(np.int32)
    return Sample(
        tokens=draw(_ints(t, 2**31 - 1)),
        logprobs=np.where(mask == 1, logprobs, 0.0).astype(np.float32),
        versions=versions,
        reward=draw(st.floats(allow_nan=False, allow_infinity=False)),
        finish_reason=draw(st.sampled_from(["stop", "length", "error"]) | _text),
        mask=mask,
        status=draw(st.sampled_from(["ok", "timeout", "env_error"])),
        turns=draw(st.integers(1, 50)),
    )


@st.composite
def groups(draw) -> TrajectoryGroup:
    return TrajectoryGroup(
        prompt_ids=draw(st.integers(0, 16).flatmap(lambda n: _ints(n, 2**31 - 1))),
        samples=draw(st.lists(samples(), min_size=1, max_size=4).filter(lambda ss: any(s.status == "ok" for s in ss))),
        prompt_index=draw(st.integers(0, 2**40)),
        epoch=draw(st.integers(0, 1000)),
        producer=draw(_text),
        id=draw(st.uuids().map(lambda u: u.hex)),
        created_at=draw(st.floats(0, 4e9)),
    )


def _group(**overrides) -> TrajectoryGroup:
    sample = Sample(
        tokens=np.array([5, 6, 7], np.int32),
        logprobs=np.array([-0.1, -0.2, -0.3], np.float32),
        versions=np.array([2, 2, 3], np.int32),
        reward=1.0,
    )
    fields = dict(prompt_ids=np.arange(4, dtype=np.int32), samples=[sample], prompt_index=3, epoch=0, producer="gen-0")
    return TrajectoryGroup(**{**fields, **overrides})


def _mutated(mutate) -> bytes:
    """A valid frame, unpacked, changed by ``mutate(obj)``, packed again."""
    obj = msgpack.unpackb(encode_group(_group()), raw=False)
    mutate(obj)
    return msgpack.packb(obj, use_bin_type=True)


def _set_array(obj: dict, values: np.ndarray) -> None:
    obj.update(pack_array(values))


# ----- round trips ------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(groups())
def test_round_trip(group: TrajectoryGroup) -> None:
    back = decode_group(encode_group(group))
    for field in ("id", "producer", "prompt_index", "epoch", "created_at"):
        assert getattr(back, field) == getattr(group, field)
    np.testing.assert_array_equal(back.prompt_ids, group.prompt_ids)
    assert len(back.samples) == len(group.samples)
    for got, want in zip(back.samples, group.samples, strict=True):
        for name in ("tokens", "mask", "logprobs", "versions"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
        assert (got.reward, got.finish_reason, got.status, got.turns) == (
            want.reward,
            want.finish_reason,
            want.status,
            want.turns,
        )
    assert back.version == min(int(s.versions[s.mask == 1].min()) for s in group.samples)  # model tokens only
    assert back.num_tokens == group.num_tokens
    np.testing.assert_array_equal(back.rewards, group.rewards)


@settings(max_examples=50)
@given(
    hnp.arrays(
        st.sampled_from([np.int32, np.int64, np.float32, np.float64, np.uint8]),
        hnp.array_shapes(min_dims=1, max_dims=3, max_side=4),  # 0-d arrays come back 1-d (ascontiguousarray)
    )
)
def test_array_round_trip(arr: np.ndarray) -> None:
    back = unpack_array(msgpack.unpackb(msgpack.packb(pack_array(arr)), raw=False))
    assert back.dtype == arr.dtype and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)


def test_group_version_is_the_oldest_token() -> None:
    assert _group().version == 2


def test_environment_tokens_have_no_version_and_count_nothing() -> None:
    sample = Sample(
        tokens=np.array([5, 6, 7, 8], np.int32),
        logprobs=np.array([-0.1, 0.0, 0.0, -0.3], np.float32),
        versions=np.array([4, -1, -1, 3], np.int32),
        reward=1.0,
        mask=np.array([1, 0, 0, 1], np.uint8),
        turns=2,
    )
    group = decode_group(encode_group(_group(samples=[sample])))
    assert group.version == 3 and group.num_tokens == 2 and group.samples[0].turns == 2


def test_a_version_1_frame_is_still_read_as_all_model_tokens() -> None:
    def to_v1(obj: dict) -> None:
        obj["schema_version"] = 1
        for s in obj["samples"]:
            for field in ("mask", "status", "turns"):
                del s[field]

    group = decode_group(_mutated(to_v1))
    assert group.samples[0].mask.tolist() == [1, 1, 1] and group.samples[0].status == "ok"
    assert group.version == 2 and group.num_tokens == 3


@pytest.mark.parametrize(
    "mask, versions, match",
    [
        ([0, 0, 0], [-1, -1, -1], "an ok sample without model tokens"),
        ([1, 2, 1], [2, 2, 3], "mask values"),
        ([1, 0, 1], [2, 2, 3], "-1 on environment tokens"),
        ([1, 1, 1], [2, -1, 3], ">= 0 on model tokens"),
        ([1, 1], [2, 2, 3], "inconsistent sample shapes"),
    ],
)
def test_rejects_inconsistent_masks(mask, versions, match) -> None:
    def mutate(obj: dict) -> None:
        _set_array(obj["samples"][0]["mask"], np.array(mask, np.uint8))
        _set_array(obj["samples"][0]["versions"], np.array(versions, np.int32))

    with pytest.raises(ProtocolError, match=match):
        decode_group(_mutated(mutate))


# ----- rejections -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame, match",
    [
        (b"\xc1", "not msgpack"),  # 0xc1 is never used in msgpack
        (b"", "not msgpack"),
        (encode_group(_group())[:-3], "not msgpack"),  # truncated
        (encode_group(_group()) + b"\x00", "not msgpack"),  # trailing bytes
        (msgpack.packb([1, 2, 3]), "not an asyncrl.traj frame"),
        (msgpack.packb({"schema": "other"}), "not an asyncrl.traj frame"),
    ],
    ids=["reserved-byte", "empty", "truncated", "trailing", "list", "other-schema"],
)
def test_rejects_what_is_not_a_trajectory_frame(frame: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_group(frame)


@pytest.mark.parametrize("version", [0, TRAJ_SCHEMA_VERSION + 1, "1", None])
def test_rejects_other_schema_versions(version) -> None:
    with pytest.raises(ProtocolError, match="schema version"):
        decode_group(_mutated(lambda o: o.update(schema_version=version)))


def _shape_cases():
    yield "logprobs-shorter", lambda o: _set_array(o["samples"][0]["logprobs"], np.zeros(2, np.float32))
    yield "versions-longer", lambda o: _set_array(o["samples"][0]["versions"], np.zeros(4, np.int32))
    yield (
        "tokens-2d",
        lambda o: [
            _set_array(o["samples"][0][k], np.zeros((1, 3), dt))
            for k, dt in (("tokens", np.int32), ("logprobs", np.float32), ("versions", np.int32))
        ],
    )
    yield (
        "empty-response",
        lambda o: [
            _set_array(o["samples"][0][k], np.zeros(0, dt))
            for k, dt in (("tokens", np.int32), ("logprobs", np.float32), ("versions", np.int32))
        ],
    )
    yield "bytes-vs-shape", lambda o: o["prompt_ids"].update(shape=[5])
    yield "no-samples", lambda o: o.update(samples=[])


@pytest.mark.parametrize("mutate", [m for _, m in _shape_cases()], ids=[n for n, _ in _shape_cases()])
def test_rejects_inconsistent_shapes(mutate) -> None:
    with pytest.raises(ProtocolError):
        decode_group(_mutated(mutate))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_rejects_non_finite_logprobs_and_rewards(bad: float) -> None:
    def logprob(o):
        _set_array(o["samples"][0]["logprobs"], np.array([-0.1, bad, -0.3], np.float32))

    with pytest.raises(ProtocolError, match="non-finite"):
        decode_group(_mutated(logprob))
    with pytest.raises(ProtocolError, match="non-finite"):
        decode_group(_mutated(lambda o: o["samples"][0].update(reward=bad)))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o.pop("id"),
        lambda o: o["samples"][0].pop("tokens"),
        lambda o: o.update(samples=5),
        lambda o: o.update(samples=[None]),
        lambda o: o["prompt_ids"].update(dtype="zz"),
        lambda o: o["prompt_ids"].update(dtype="object"),
        lambda o: o["prompt_ids"].update(shape=[[1]]),
    ],
    ids=[
        "no-id",
        "no-tokens",
        "samples-not-list",
        "sample-not-map",
        "bad-dtype",
        "object-dtype",
        "nested-shape",
    ],
)
def test_rejects_missing_and_mistyped_fields(mutate) -> None:
    with pytest.raises(ProtocolError):
        decode_group(_mutated(mutate))


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200) | st.integers(1, 400).map(lambda n: encode_group(_group())[:n]))
def test_arbitrary_bytes_raise_only_protocol_error(frame: bytes) -> None:
    try:
        decode_group(frame)
    except ProtocolError:
        pass


# Mistyped values must surface as ProtocolError (a learner catches only that), never as the
# ValueError / OverflowError numpy and int() raise underneath.
@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o["prompt_ids"].update(shape=[-1, -4]),  # product matches the byte count
        lambda o: o["prompt_ids"].update(shape=["1.5"]),
        lambda o: o["prompt_ids"].update(shape=[2**62, 2**62]),
        lambda o: o.update(prompt_index="three"),
        lambda o: o["samples"][0].update(reward="high"),
    ],
    ids=["negative-shape", "string-shape", "huge-shape", "string-int-field", "string-reward"],
)
def test_mistyped_values_raise_protocol_error(mutate) -> None:
    frame = _mutated(mutate)
    try:
        decode_group(frame)
    except ProtocolError:
        return
    pytest.fail("decoded a bad frame")


def test_a_failed_sample_may_be_empty_but_a_group_needs_an_ok_one() -> None:
    """zero_sample keeps a failed episode in its group: it may hold no model token (an environment
    that failed at reset); the learner's view of the group leaves it out."""
    empty = Sample(
        np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32), 0.0, status="env_error", turns=0
    )
    group = _group()
    group.samples.append(empty)
    got = decode_group(encode_group(group))
    assert [s.status for s in got.samples] == ["ok", "env_error"]
    assert [s.status for s in got.trainable().samples] == ["ok"]
    with pytest.raises(ProtocolError, match="no ok samples"):
        decode_group(encode_group(_group(samples=[empty])))
