"""Shared pieces of the algorithm tests: tolerance, hypothesis settings, float strategies."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

TOL = 1e-6
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAN = float("nan")


def close(a: float, b: float, tol: float = TOL) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


def floats(lo: float, hi: float):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, width=64)
