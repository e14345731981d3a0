"""Delta weight versions (issue 47): a version as what changed since the one before, bit-exact, with a full
version wherever a subscriber has no base for it.

The codec is checked on its own (100 random deltas, every dtype the bus carries, NaNs and signed zeros),
then over real ZeroMQ sockets: deltas where they are small, full versions where they are not (float32),
for a subscriber that joins late or restarts, and for one that receives a corrupted delta.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from asyncrl.config import ZmqWeightsConfig
from asyncrl.weights import setup_publisher, setup_subscriber, state_dict_checksum
from asyncrl.weights.delta import Held, delta_tensors
from asyncrl.weights.wire import WeightsRejected, WeightUpdate

WAIT_S = 60


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def a_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {
        "embed": torch.randn(300, 64, generator=g).bfloat16(),
        "norm": torch.randn(64, generator=g),
        "steps": torch.arange(5),
        "mask": torch.rand(17, generator=g) > 0.5,
        "scalar": torch.tensor(1.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
    }
    state["norm"][3] = float("nan")
    state["norm"][4] = -0.0
    return state


def changed(state: dict[str, torch.Tensor], rng: random.Random) -> dict[str, torch.Tensor]:
    """A next version: per tensor none, one, some or every element changed (NaN, -0.0 and +0.0 among them)."""
    new = {name: t.clone() for name, t in state.items()}
    for t in new.values():
        n = t.numel()
        if not n:
            continue
        how = rng.choice(["none", "one", "few", "some", "all"])
        count = {"none": 0, "one": 1, "few": rng.randint(1, max(1, n // 20)), "some": rng.randint(1, n), "all": n}[how]
        where = torch.tensor(rng.sample(range(n), count), dtype=torch.int64)
        flat = t.reshape(-1)
        if t.dtype == torch.bool:
            flat[where] = ~flat[where]
        elif t.is_floating_point():
            values = torch.randn(count, dtype=torch.float64)
            special = [float("nan"), -0.0, 0.0]
            for i in range(min(count, 3)):
                values[i] = special[rng.randrange(3)]
            flat[where] = values.to(t.dtype)
        else:
            flat[where] += torch.arange(1, count + 1)
    return new


def update_of(version: int, tensors: dict[str, torch.Tensor]) -> WeightUpdate:
    return WeightUpdate(version, tensors, state_dict_checksum(tensors), 0, time.time())


def test_a_hundred_random_deltas_rebuild_every_byte():
    rng = random.Random(47)
    held = Held()
    state = a_state()
    held.take(update_of(0, state), {"full_reason": "first"})
    kinds: set[str] = set()
    for version in range(1, 101):
        new = changed(state, rng)
        payload, entries, _ = delta_tensors(state, new)
        kinds |= {e["kind"] for e in entries}
        manifest = {
            "delta": {"base": version - 1, "base_checksum": held.checksum, "tensors": entries},
            "result_checksum": state_dict_checksum(new),
        }
        got = held.take(update_of(version, payload), manifest)
        assert got.version == version and got.checksum == state_dict_checksum(new)
        assert {n: bits(t) for n, t in got.tensors.items()} == {n: bits(t) for n, t in new.items()}
        state = new
    assert kinds == {"same", "packed", "full"}  # every way a tensor travels was exercised


def test_a_delta_that_does_not_fit_the_held_version_is_refused():
    held, state = Held(), a_state()
    held.take(update_of(3, state), {"full_reason": "first"})
    new = changed(state, random.Random(1))
    payload, entries, _ = delta_tensors(state, new)
    good = {"base": 3, "base_checksum": held.checksum, "tensors": entries}
    cases = {
        "another base version": ({**good, "base": 2}, state_dict_checksum(new)),
        "another base checksum": ({**good, "base_checksum": "0" * 32}, state_dict_checksum(new)),
        "a result that does not verify": (good, "0" * 32),
    }
    for why, (delta, result) in cases.items():
        with pytest.raises(WeightsRejected):
            held.take(update_of(4, payload), {"delta": delta, "result_checksum": result})
        assert held.version == 3 and held.checksum == state_dict_checksum(state), why


def poll_until(sub, version: int) -> WeightUpdate:
    deadline = time.monotonic() + WAIT_S
    while True:
        update = sub.poll(timeout_ms=100)
        if update is not None and update.version >= version:
            assert update.version == version, f"wanted version {version}, got {update.version}"
            return update
        assert time.monotonic() < deadline, f"version {version} never arrived"


def train(state: dict[str, torch.Tensor], version: int, fraction: float) -> dict[str, torch.Tensor]:
    """A learner step's effect on bfloat16 weights: about ``fraction`` of the elements move."""
    g = torch.Generator().manual_seed(version)
    return {
        n: torch.where(torch.rand(t.shape, generator=g) < fraction, t + t.abs() * 0.05 + 0.01, t)
        if t.is_floating_point()
        else t
        for n, t in state.items()
    }


def bf16_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(256, 128, generator=g).bfloat16() for i in range(4)}


@pytest.fixture(params=["direct", "relay"])
def bus(tmp_path, request):
    """A delta-sending zmq publisher, direct fan-out or a relay chain (each subscriber fed by the one
    before it), and a factory of its subscribers."""
    cfg = ZmqWeightsConfig(bucket_mb=1, full_every=0, relay=request.param == "relay")
    pub = setup_publisher(cfg, f"ipc://{tmp_path}/w.sock")
    subs = []

    def subscriber(name: str, have: int = -1):
        subs.append(setup_subscriber(cfg, pub.address, name, have))
        return subs[-1]

    yield pub, subscriber
    for s in subs:
        s.close()
    pub.close()


def test_bfloat16_versions_travel_as_deltas_and_a_late_joiner_serves_exactly_its_version(bus):
    pub, subscriber = bus
    first = subscriber("g0")
    state = bf16_state()
    full_bytes = sum(t.numel() * t.element_size() for t in state.values())
    for version in range(1, 21):
        state = train(state, version, 0.02)
        pub.publish(version, state)
        got = poll_until(first, version)
        assert got.checksum == state_dict_checksum(state)
        assert got.sent["kind"] == ("full" if version == 1 else "delta")
        if version > 1:
            assert got.sent["bytes"] < 0.2 * full_bytes
            assert 0.01 < got.sent["changed_fraction"] < 0.03
    late = subscriber("g1")  # joins at version 20 of the chain
    got = poll_until(late, 20)
    assert got.sent["kind"] == "full" and got.checksum == state_dict_checksum(state)
    assert {n: bits(t) for n, t in got.tensors.items()} == {n: bits(t) for n, t in state.items()}
    if hasattr(late, "relay_address"):  # relayed: the first generator made the full version from its deltas
        assert late.upstream == first.relay_address and "relay" in got.sent["full_reason"]
    state = train(state, 21, 0.02)
    pub.publish(21, state)
    for sub in (first, late):  # from here on both hold version 20: the delta serves both
        got = poll_until(sub, 21)
        assert got.sent["kind"] == "delta" and got.checksum == state_dict_checksum(state)


def test_a_restarted_generator_gets_a_full_version(bus):
    pub, subscriber = bus
    sub = subscriber("g0")
    state = bf16_state()
    for version in (1, 2):
        state = train(state, version, 0.02)
        pub.publish(version, state)
        poll_until(sub, version)
    sub.close()
    restarted = subscriber("g0", have=2)  # its engine loaded version 2 from a checkpoint: it holds no tensors
    state = train(state, 3, 0.02)
    pub.publish(3, state)
    got = poll_until(restarted, 3)
    assert got.sent["kind"] == "full" and got.checksum == state_dict_checksum(state)


def test_float32_versions_go_full_and_say_why(bus):
    pub, subscriber = bus
    sub = subscriber("g0")
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(256, 256, generator=g)}
    for version in range(1, 4):
        state = {"w": state["w"] - 1e-4 * torch.randn(256, 256, generator=g)}  # every element moves
        pub.publish(version, state)
        got = poll_until(sub, version)
        assert got.sent["kind"] == "full" and got.checksum == state_dict_checksum(state)
    assert "more than 0.5 of the bytes" in got.sent["full_reason"]


def corrupt_delta_of(pub, version: int) -> None:
    """Flip one byte of ``version``'s delta after its checksums were made, as a bad link or disk would."""
    seal = pub._deltas.seal

    def corrupting(snap):
        frames, delta = seal(snap)
        if snap.version == version and delta is not None:
            delta[1][2][7] ^= 0x40
        return frames, delta

    pub._deltas.seal = corrupting


def test_a_corrupted_delta_is_refused_and_a_full_version_fetched(bus):
    pub, subscriber = bus
    corrupt_delta_of(pub, 3)
    sub = subscriber("g0")
    state = bf16_state()
    for version in (1, 2):
        state = train(state, version, 0.02)
        pub.publish(version, state)
        assert poll_until(sub, version).sent["kind"] == ("full" if version == 1 else "delta")
    state = train(state, 3, 0.02)
    pub.publish(3, state)
    got = poll_until(sub, 3)  # the delta was refused; the full version 3 came on request
    assert sub.rejected == 1
    assert got.sent["kind"] == "full" and got.sent.get("asked")
    assert got.checksum == state_dict_checksum(state)
    state = train(state, 4, 0.02)
    pub.publish(4, state)
    assert poll_until(sub, 4).sent["kind"] == "delta"  # and deltas resume on top of it
    if "delta_sends" in pub.stats():  # the direct publisher counts its sends by kind
        deadline = time.monotonic() + WAIT_S  # the thread counts a send after it queued it
        while pub.stats()["delta_sends"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert pub.stats()["delta_sends"] == 3 and pub.stats()["full_sends"] == 2


def test_a_malformed_packed_payload_is_refused():
    """A payload that is not what its entry says (a truncated or foreign zlib stream, another count, a
    position past the tensor's end) is refused before anything is applied."""
    import zlib

    import numpy as np

    held, state = Held(), a_state()
    held.take(update_of(3, state), {"full_reason": "first"})
    new = {n: t.clone() for n, t in state.items()}
    new["embed"].view(-1)[:10] = new["embed"].view(-1)[:10] + 1
    payload, entries, _ = delta_tensors(state, new)
    (embed,) = [e for e in entries if e["name"] == "embed"]
    assert embed["kind"] == "packed" and embed["count"] == 10

    def packed(values, dtype) -> torch.Tensor:
        return torch.frombuffer(bytearray(zlib.compress(np.array(values, dtype).tobytes())), dtype=torch.uint8)

    cases = {
        "a truncated stream": ({}, {"embed@gaps": payload["embed@gaps"][:-3]}),
        "a stream that is not zlib": ({}, {"embed@xor": torch.arange(40, dtype=torch.uint8)}),
        "another count": ({"count": 11}, {}),
        "a position past the end": (
            {"count": 1},
            {"embed@gaps": packed([10**9], "<u8"), "embed@xor": packed([1], "<i2")},
        ),
        "a payload tensor of no entry": ({}, {"stray": torch.zeros(3)}),
    }
    for why, (entry_change, payload_change) in cases.items():
        bad_entries = [{**e, **entry_change} if e["name"] == "embed" else e for e in entries]
        manifest = {
            "delta": {"base": 3, "base_checksum": held.checksum, "tensors": bad_entries},
            "result_checksum": state_dict_checksum(new),
        }
        with pytest.raises(WeightsRejected):
            held.take(update_of(4, {**payload, **payload_change}), manifest)
        assert held.version == 3 and held.checksum == state_dict_checksum(state), why
