"""The live fleet on a real redis-server: leases, clean leaves, reaping, and admission records.

Lease expiry is driven by Redis's own clock with short leases (0.3 s) and waits on the outcome,
never on a sleep of a guessed length.
"""

from __future__ import annotations

import time

import pytest

from asyncrl.buffers import run_prefix
from asyncrl.buffers import setup as setup_buffer
from asyncrl.config import RedisBufferConfig
from asyncrl.control import RunControl, connect
from asyncrl.errors import UserError
from asyncrl.fleet.rendezvous import redis_url
from asyncrl.secret import derive, new_secret, read_secret, redis_password

pytestmark = pytest.mark.redis


@pytest.fixture
def run(redis_server, request):
    prefix = run_prefix(f"fleet-{request.node.name}-{time.monotonic_ns()}")
    control = RunControl(connect(redis_server.url), prefix)
    buffer = setup_buffer(RedisBufferConfig(), redis_server.url, prefix)
    yield control, buffer
    buffer.close()


def wait_until(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)
    return value


def test_a_member_is_live_while_it_renews_and_gone_at_once_when_it_leaves(run):
    control, _ = run
    token = control.join("generator", "a")
    assert control.members("generator") == ["a"]
    assert control.renew("generator", "a", token, version=3)
    assert control.heartbeats("generator")["a"]["version"] == "3"
    control.leave("generator", "a", token)
    assert control.members("generator") == [] and "a" not in control.heartbeats("generator")
    assert not control.renew("generator", "a", token)  # a left member cannot come back with its old lease


def test_an_expired_lease_is_reaped_once_its_slots_taken_and_its_holder_told(run):
    control, buffer = run
    stalled = control.join("generator", "s", ttl_s=0.3)
    control.join("generator", "live", ttl_s=60)
    for _ in range(3):
        buffer.try_start_group(0, 1, 2, producer="s")
    wait_until(lambda: control.members("generator") == ["live"])
    assert control.reap("generator") == {"s": 3}
    assert control.reap("generator") == {}  # atomic: a second reaper takes nothing
    assert not control.renew("generator", "s", stalled)  # woke up: it must stop, its slots are gone
    assert control.members("generator") == ["live"]


def test_a_restarted_process_takes_over_its_id_and_the_old_one_loses_it(run):
    control, _ = run
    old = control.join("generator", "0")
    new = control.join("generator", "0")
    assert not control.renew("generator", "0", old) and control.renew("generator", "0", new)
    control.leave("generator", "0", old)  # the old process's exit does not end the new one's lease
    assert control.members("generator") == ["0"]


def test_joining_processes_get_distinct_ids(run):
    control, _ = run
    assert len({control.new_id("generator", "host") for _ in range(5)}) == 5


def test_every_admission_is_recorded_with_the_limit_it_was_judged_against(run):
    _, buffer = run
    admitted = [buffer.try_start_group(0, 1, 2) for _ in range(6)]
    assert admitted == [0, 1, 2, 3, None, None]  # (0 + 1 + 1) * 2 = 4 slots
    buffer.release(2)
    assert buffer.try_start_group(0, 1, 2) == 4
    records = buffer.admissions()
    assert [seq for seq, _, _ in records] == [0, 1, 2, 3, 4]
    assert [live for _, live, _ in records] == [1, 2, 3, 4, 3]
    assert all(live <= limit == 4 for _, live, limit in records)


def test_credentials_derive_from_the_secret_and_nothing_else(tmp_path, monkeypatch):
    secret = new_secret()
    assert derive(secret, "a") != derive(secret, "b") and derive(secret, "a") == derive(secret, "a")
    assert redis_password(secret) != redis_password(new_secret())
    assert redis_password(secret) in redis_url("10.0.0.1:6379", secret)
    with pytest.raises(UserError, match="HOST:PORT"):
        redis_url("10.0.0.1", secret)
    monkeypatch.setenv("ASYNCRL_SECRET", secret)
    assert read_secret() == secret
    monkeypatch.setenv("ASYNCRL_SECRET", "not-hex")
    with pytest.raises(UserError, match="64 hex digits") as err:
        read_secret()
    assert "not-hex" not in str(err.value)  # a bad secret is not echoed either
    path = tmp_path / "secret"
    path.write_text(secret + "\n")
    path.chmod(0o644)
    with pytest.raises(UserError, match="chmod 600"):
        read_secret(path)
    path.chmod(0o600)
    assert read_secret(path) == secret


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"run.host": "0.0.0.0"}, "would listen everywhere"),
        ({"run.host": "203.0.113.77"}, "is not an address of this machine"),  # TEST-NET-3
        ({"run.host": "203.0.113.77", "weights.type": "shm"}, "serves one host only"),
        ({"run.learners": 2, "run.local_learners": 1}, "need --host"),
        ({"run.learners": 2, "run.local_learners": 3}, "more than run.learners"),
    ],
)
def test_a_run_host_that_cannot_work_is_one_clear_error(overrides, message):
    from asyncrl.config import load_config
    from asyncrl.run.preflight import check_host

    with pytest.raises(UserError, match=message):
        check_host(load_config(None, overrides))
    check_host(load_config(None, {"run.host": "127.0.0.1"}))
