"""What a process without a run's secret gets from the run's advertised addresses (run inside a test's
network namespace: "another host"). Prints one JSON object: each attempt -> what happened.

    python tests/intruder.py REDIS_HOST:PORT PREFIX WEIGHTS_ADDRESS
"""

from __future__ import annotations

import json
import sys
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncrl.config import ZmqWeightsConfig
from asyncrl.keys import RunKeys
from asyncrl.secret import new_secret
from asyncrl.weights import setup_subscriber


def redis_attempts(address: str, prefix: str) -> dict[str, str]:
    host, port = address.rsplit(":", 1)
    keys, out = RunKeys(prefix), {}
    for who, password in (("redis without a password", None), ("redis with a wrong password", new_secret())):
        client = redis.Redis(  # no retry: redis-py retries even a refused password, with backoff (seconds)
            host=host, port=int(port), password=password, socket_timeout=5, socket_connect_timeout=5,
            retry=Retry(NoBackoff(), 0),
        )  # fmt: skip
        for what, call in (
            ("push a trajectory", lambda c: c.xadd(keys.traj, {"gid": "x", "producer": "intruder", "frame": b"x"})),
            ("read trajectories", lambda c: c.xrange(keys.traj, count=1)),
            ("advertise weights", lambda c: c.hset(keys.meta, "weights_address", "tcp://10.0.0.1:1")),
        ):
            try:
                call(client)
                out[f"{who}: {what}"] = "accepted"
            except redis.RedisError as exc:
                out[f"{who}: {what}"] = type(exc).__name__
        client.close()
    return out


def weight_attempts(address: str, wait_s: float = 5.0) -> dict[str, int | None]:
    """Both subscribers listen at once, each for the whole ``wait_s``: the version either got, or None."""
    attempts = [
        ("weights without the secret", "intruder", None),
        ("weights with a wrong secret", "intruder-2", new_secret()),
    ]
    subs = {
        who: setup_subscriber(ZmqWeightsConfig(relay=False), address, ident, secret=secret)
        for who, ident, secret in attempts
    }
    out: dict[str, int | None] = dict.fromkeys(subs)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for who, sub in subs.items():
            if out[who] is None and (update := sub.poll(100)) is not None:
                out[who] = update.version
    for sub in subs.values():
        sub.close()
    return out


if __name__ == "__main__":
    print(json.dumps({**redis_attempts(sys.argv[1], sys.argv[2]), **weight_attempts(sys.argv[3])}))
