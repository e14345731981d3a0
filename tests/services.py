"""Whether a test runs under CI, and what a test needing a service does when the service is missing: skip on
a laptop, FAIL under CI (``CI=true``), since CI must never pass by skipping the service it is meant to test."""

from __future__ import annotations

import os
import shutil

import pytest

from asyncrl.fleet.redis_server import REDIS_BINARY


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_redis_binary() -> None:
    if shutil.which(REDIS_BINARY) is None:
        msg = f"{REDIS_BINARY} not on PATH (apt-get install redis-server)"
        if in_ci():
            pytest.fail(msg + "; CI=true, so this is a failure, not a skip")
        pytest.skip(msg)
