"""Wire formats that cross process boundaries. Never pickle.

A trajectory group (one prompt, ``n`` samples) travels as one msgpack map::

    {"schema": "asyncrl.traj", "schema_version": 1,
     "id": str,              # unique per group; duplicates are ignored by the buffer
     "producer": str,        # generator id, for dead letters and status
     "prompt_index": int, "epoch": int,
     "prompt_ids": <array int32 (P,)>,
     "samples": [{"tokens": <array int32 (T,)>,     # response token ids
                  "logprobs": <array float32 (T,)>, # behaviour log pi_mu(a_t | s_t), as sampled
                  "versions": <array int32 (T,)>,   # policy version that produced each token
                  "reward": float, "finish_reason": str}, ...],
     "created_at": float}

Arrays are maps ``{"dtype": str, "shape": [..], "data": bytes}`` (little-endian raw bytes).
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid

import msgpack
import numpy as np

from asyncrl.staleness import trajectory_version

TRAJ_SCHEMA = "asyncrl.traj"
TRAJ_SCHEMA_VERSION = 1
_ALLOWED_DTYPES = {"int32", "int64", "float32", "float64", "uint8"}


class ProtocolError(ValueError):
    """A frame that cannot be decoded into a valid message; the reason is the message."""


def pack_array(arr: np.ndarray) -> dict:
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return {"dtype": arr.dtype.str.lstrip("<|="), "shape": list(arr.shape), "data": arr.tobytes()}


def unpack_array(obj: dict) -> np.ndarray:
    try:
        dtype = np.dtype(obj["dtype"]).newbyteorder("<")
        shape = tuple(int(s) for s in obj["shape"])
        data = obj["data"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed array: {exc}") from None
    if dtype.name not in _ALLOWED_DTYPES:
        raise ProtocolError(f"dtype {dtype.name} not allowed")
    if any(s < 0 for s in shape) or not isinstance(data, bytes):
        raise ProtocolError(f"malformed array: shape {shape}")
    if math.prod(shape) * dtype.itemsize != len(data):
        raise ProtocolError(f"array shape {shape} does not match {len(data)} bytes of {dtype.name}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


@dataclasses.dataclass
class Sample:
    tokens: np.ndarray  # (T,) int32 response token ids
    logprobs: np.ndarray  # (T,) float32 behaviour log-probs of the sampled tokens
    versions: np.ndarray  # (T,) int32 policy version that produced each token
    reward: float
    finish_reason: str = "stop"


@dataclasses.dataclass
class TrajectoryGroup:
    prompt_ids: np.ndarray  # (P,) int32
    samples: list[Sample]
    prompt_index: int
    epoch: int
    producer: str
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = dataclasses.field(default_factory=time.time)

    @property
    def version(self) -> int:
        """The oldest policy version among all tokens of all samples (the lag bound uses this)."""
        return min(trajectory_version(s.versions) for s in self.samples if len(s.versions))

    @property
    def rewards(self) -> np.ndarray:
        return np.array([s.reward for s in self.samples], dtype=np.float64)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)


def encode_group(group: TrajectoryGroup) -> bytes:
    return msgpack.packb(
        {
            "schema": TRAJ_SCHEMA,
            "schema_version": TRAJ_SCHEMA_VERSION,
            "id": group.id,
            "producer": group.producer,
            "prompt_index": group.prompt_index,
            "epoch": group.epoch,
            "prompt_ids": pack_array(group.prompt_ids.astype(np.int32)),
            "samples": [
                {
                    "tokens": pack_array(s.tokens.astype(np.int32)),
                    "logprobs": pack_array(s.logprobs.astype(np.float32)),
                    "versions": pack_array(s.versions.astype(np.int32)),
                    "reward": float(s.reward),
                    "finish_reason": s.finish_reason,
                }
                for s in group.samples
            ],
            "created_at": group.created_at,
        },
        use_bin_type=True,
    )


def decode_group(frame: bytes) -> TrajectoryGroup:
    """Decode and validate one frame; raises :class:`ProtocolError` naming what is wrong."""
    try:
        obj = msgpack.unpackb(frame, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(obj, dict) or obj.get("schema") != TRAJ_SCHEMA:
        raise ProtocolError("not an asyncrl.traj frame")
    if obj.get("schema_version") != TRAJ_SCHEMA_VERSION:
        raise ProtocolError(f"unknown schema version {obj.get('schema_version')!r}")
    try:
        samples = [_decode_sample(s) for s in obj["samples"]]
        group = TrajectoryGroup(
            prompt_ids=unpack_array(obj["prompt_ids"]),
            samples=samples,
            prompt_index=int(obj["prompt_index"]),
            epoch=int(obj["epoch"]),
            producer=str(obj["producer"]),
            id=str(obj["id"]),
            created_at=float(obj["created_at"]),
        )
    except ProtocolError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"missing or mistyped field: {exc}") from None
    if not samples:
        raise ProtocolError("group has no samples")
    return group


def _decode_sample(obj: dict) -> Sample:
    s = Sample(
        tokens=unpack_array(obj["tokens"]),
        logprobs=unpack_array(obj["logprobs"]),
        versions=unpack_array(obj["versions"]),
        reward=float(obj["reward"]),
        finish_reason=str(obj.get("finish_reason", "stop")),
    )
    if not (s.tokens.shape == s.logprobs.shape == s.versions.shape) or s.tokens.ndim != 1:
        raise ProtocolError(f"inconsistent sample shapes {s.tokens.shape}, {s.logprobs.shape}, {s.versions.shape}")
    if len(s.tokens) == 0:
        raise ProtocolError("empty response")
    if not np.all(np.isfinite(s.logprobs)) or not math.isfinite(s.reward):
        raise ProtocolError("non-finite log-prob or reward")
    return s
