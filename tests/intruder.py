"""What a process without a run's secret gets from the run's advertised addresses (run inside a test's
network namespace: "another host"). Prints one JSON object: each attempt -> what happened.

    python tests/intruder.py REDIS_HOST:PORT PREFIX WEIGHTS_ADDRESS
"""

from __future__ import annotations

import json
import sys
import time

import redis

from asyncrl.config import ZmqWeightsConfig
from asyncrl.keys import RunKeys
from asyncrl.secret import new_secret
from asyncrl.weights import setup_subscriber


def redis_attempts(address: str, prefix: str) -> dict[str, str]:
    host, port = address.rsplit(":", 1)
    keys, out = RunKeys(prefix), {}
    for who, password in (("redis without a password", None), ("redis with a wrong password", new_secret())):
        client = redis.Redis(host=host, port=int(port), password=password, socket_timeout=5, socket_connect_timeout=5)
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
    out = {}
    for who, secret in (("weights without the secret", None), ("weights with a wrong secret", new_secret())):
        sub = setup_subscriber(ZmqWeightsConfig(relay=False), address, "intruder", secret=secret)
        got, deadline = None, time.monotonic() + wait_s
        while got is None and time.monotonic() < deadline:
            update = sub.poll(200)
            got = None if update is None else update.version
        sub.close()
        out[who] = got
    return out


if __name__ == "__main__":
    print(json.dumps({**redis_attempts(sys.argv[1], sys.argv[2]), **weight_attempts(sys.argv[3])}))
