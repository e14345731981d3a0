"""Wire formats that cross process boundaries. Never pickle.

A trajectory group (one prompt, ``n`` samples) travels as one msgpack map::

    {"schema": "asyncrl.traj", "schema_version": 2,
     "id": str,              # unique per group; duplicates are ignored by the buffer
     "producer": str,        # generator id, for dead letters and status
     "prompt_index": int, "epoch": int,
     "prompt_ids": <array int32 (P,)>,
     "samples": [{"tokens": <array int32 (T,)>,     # everything after the prompt, every turn
                  "mask": <array uint8 (T,)>,       # 1: sampled by the policy; 0: environment / tool
                  "logprobs": <array float32 (T,)>, # behaviour log pi_mu(a_t | s_t) at mask 1; 0 at mask 0
                  "versions": <array int32 (T,)>,   # version that produced each mask-1 token; -1 at mask 0
                  "reward": float, "finish_reason": str,
                  "status": str,                    # "ok", or why the episode failed
                  "turns": int,                     # model turns in the episode (1: single-turn)
                  "turn_rewards": <array float32 (T,)>,  # optional: each turn's reward at its
                                                    # last model token (they sum to "reward")
                  "routes": <array uint8 (R, layers, top_k)>}, ...],  # optional (rollout routing replay):
                                                    # the experts the engine routed positions 0..R-1 of
                                                    # prompt ++ tokens to, R <= P + T
     "created_at": float,
     "images": [{"sha256": str, "path": str} | {"sha256": str, "data": bytes}, ...]}  # version 3 only

``images`` (version 3, written only by a group whose prompt has images): the prompt's images in order, each a
file by path and content hash, or inline (:class:`asyncrl.data.ImageRef`); ``prompt_ids`` are then the
processor's EXPANDED ids, each image's tokens in place (context: no gradient, no count, like the prompt). A
group without images is written as version 2, which learners of the last release still read.

Environment tokens (mask 0) are context only: no gradient, not counted in any token total, no
version. A sample whose status is ``ok`` has at least one model token; a group's version is the
oldest MODEL token's. A sample of another status is a failed episode kept under
``episode.failure_policy: zero_sample``: it may be empty, its reward means nothing, and the learner
leaves it out (:meth:`TrajectoryGroup.trainable`); a group has at least one ``ok`` sample.
Version 1 frames (no ``mask``, ``status``, ``turns``: every token the model's) are still read.

Arrays are maps ``{"dtype": str, "shape": [..], "data": bytes}`` (little-endian raw bytes).
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid

import msgpack
import numpy as np

from asyncrl.data import ImageRef
from asyncrl.staleness import trajectory_version

TRAJ_SCHEMA = "asyncrl.traj"
TRAJ_SCHEMA_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)  # a learner still reads frames of the previous versions
_TEXT_VERSION = 2  # what a group without images is written as
ENV_VERSION = -1  # the version recorded on environment tokens
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
    tokens: np.ndarray  # (T,) int32 token ids after the prompt (model and environment turns)
    logprobs: np.ndarray  # (T,) float32 behaviour log-probs of the sampled tokens (0 at mask 0)
    versions: np.ndarray  # (T,) int32 policy version that produced each token (-1 at mask 0)
    reward: float
    finish_reason: str = "stop"
    mask: np.ndarray | None = None  # (T,) uint8 1 = sampled by the policy, 0 = environment; None: all 1
    status: str = "ok"
    turns: int = 1
    turn_rewards: np.ndarray | None = None  # (T,) float32 each turn's reward at its last model token; None: none
    routes: np.ndarray | None = None  # (R, layers, top_k) uint8 the engine's experts per position of prompt ++ tokens

    def __post_init__(self) -> None:
        if self.mask is None:
            self.mask = np.ones(len(self.tokens), dtype=np.uint8)

    @property
    def model_versions(self) -> np.ndarray:
        """(M,) the versions of the model tokens."""
        return self.versions[self.mask.astype(bool)]


@dataclasses.dataclass
class TrajectoryGroup:
    prompt_ids: np.ndarray  # (P,) int32
    samples: list[Sample]
    prompt_index: int
    epoch: int
    producer: str
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = dataclasses.field(default_factory=time.time)
    images: list[ImageRef] = dataclasses.field(default_factory=list)  # the prompt's, in order (a VLM's)

    @property
    def version(self) -> int:
        """The oldest policy version among the model tokens of all samples (the lag bound uses this)."""
        return min(trajectory_version(s.model_versions) for s in self.samples if len(s.model_versions))

    def trainable(self) -> TrajectoryGroup:
        """This group with only its ``ok`` samples: failed episodes take part in nothing the learner
        computes (advantages, losses, counts)."""
        ok = [s for s in self.samples if s.status == "ok"]
        return self if len(ok) == len(self.samples) else dataclasses.replace(self, samples=ok)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([s.reward for s in self.samples], dtype=np.float64)

    @property
    def num_tokens(self) -> int:
        """Model tokens of all samples (environment tokens are not the policy's output)."""
        return sum(int(s.mask.sum()) for s in self.samples)


def encode_group(group: TrajectoryGroup) -> bytes:
    return msgpack.packb(
        {
            "schema": TRAJ_SCHEMA,
            "schema_version": TRAJ_SCHEMA_VERSION if group.images else _TEXT_VERSION,
            "id": group.id,
            "producer": group.producer,
            "prompt_index": group.prompt_index,
            "epoch": group.epoch,
            "prompt_ids": pack_array(group.prompt_ids.astype(np.int32)),
            "samples": [
                {
                    "tokens": pack_array(s.tokens.astype(np.int32)),
                    "mask": pack_array(s.mask.astype(np.uint8)),
                    "logprobs": pack_array(s.logprobs.astype(np.float32)),
                    "versions": pack_array(s.versions.astype(np.int32)),
                    "reward": float(s.reward),
                    "finish_reason": s.finish_reason,
                    "status": s.status,
                    "turns": int(s.turns),
                    **(
                        {}
                        if s.turn_rewards is None
                        else {"turn_rewards": pack_array(s.turn_rewards.astype(np.float32))}
                    ),
                    **({} if s.routes is None else {"routes": pack_array(s.routes.astype(np.uint8))}),
                }
                for s in group.samples
            ],
            "created_at": group.created_at,
            **({"images": [ref.to_wire() for ref in group.images]} if group.images else {}),
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
    schema_version = obj.get("schema_version")
    if type(schema_version) is not int or schema_version not in _READABLE_VERSIONS:
        raise ProtocolError(f"unknown schema version {schema_version!r}")
    try:
        samples = [_decode_sample(s, schema_version) for s in obj["samples"]]
        group = TrajectoryGroup(
            prompt_ids=unpack_array(obj["prompt_ids"]),
            samples=samples,
            prompt_index=int(obj["prompt_index"]),
            epoch=int(obj["epoch"]),
            producer=str(obj["producer"]),
            id=str(obj["id"]),
            created_at=float(obj["created_at"]),
            images=[ImageRef.from_wire(ref) for ref in obj["images"]]
            if schema_version >= 3 and "images" in obj
            else [],
        )
    except ProtocolError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"missing or mistyped field: {exc}") from None
    if not any(s.status == "ok" for s in samples):
        raise ProtocolError("group has no ok samples")
    if any(s.routes is not None and len(s.routes) > len(group.prompt_ids) + len(s.tokens) for s in samples):
        raise ProtocolError("routes for more positions than the prompt and sample have")
    return group


def _decode_sample(obj: dict, schema_version: int) -> Sample:
    s = Sample(
        tokens=unpack_array(obj["tokens"]),
        logprobs=unpack_array(obj["logprobs"]),
        versions=unpack_array(obj["versions"]),
        reward=float(obj["reward"]),
        finish_reason=str(obj.get("finish_reason", "stop")),
        mask=unpack_array(obj["mask"]) if schema_version >= 2 else None,
        status=str(obj["status"]) if schema_version >= 2 else "ok",
        turns=int(obj["turns"]) if schema_version >= 2 else 1,
        turn_rewards=unpack_array(obj["turn_rewards"]) if "turn_rewards" in obj else None,
        routes=unpack_array(obj["routes"]) if "routes" in obj else None,
    )
    if s.routes is not None and (s.routes.ndim != 3 or s.routes.dtype != np.uint8):
        raise ProtocolError(f"routes must be (positions, layers, top_k) uint8, got {s.routes.dtype} {s.routes.shape}")
    shapes = (s.tokens.shape, s.mask.shape, s.logprobs.shape, s.versions.shape)
    if s.turn_rewards is not None:
        shapes += (s.turn_rewards.shape,)
    if len(set(shapes)) != 1 or s.tokens.ndim != 1:
        raise ProtocolError(f"inconsistent sample shapes {', '.join(map(str, shapes))}")
    if s.turn_rewards is not None and (
        not np.all(np.isfinite(s.turn_rewards)) or np.any(s.turn_rewards[s.mask == 0] != 0)
    ):
        raise ProtocolError("turn rewards must be finite, and 0 on environment tokens")
    if not np.all(np.isfinite(s.logprobs)) or not math.isfinite(s.reward):
        raise ProtocolError("non-finite log-prob or reward")
    model = s.mask == 1
    if not np.all(model | (s.mask == 0)):
        raise ProtocolError("mask values other than 0 and 1")
    if s.status == "ok" and not model.any():
        raise ProtocolError("an ok sample without model tokens" if len(s.tokens) else "empty response")
    if np.any(s.versions[model] < 0) or np.any(s.versions[~model] != ENV_VERSION):
        raise ProtocolError("versions must be >= 0 on model tokens and -1 on environment tokens")
    if s.turns < (1 if s.status == "ok" else 0):
        raise ProtocolError(f"turns must be >= 1, got {s.turns}")
    return s
