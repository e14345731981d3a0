"""Shared pieces of the algorithm tests: tolerances per dtype, hypothesis settings, float strategies.

Every reference comparison runs in float64 (the reference's own precision) and in float32 (the
learner's): the float32 inputs are rounded to float32 FIRST and the float64 reference is evaluated on
the rounded values, so the comparison measures the implementation's float32 arithmetic only.

Kinks (a clip edge, a tie of max(a, b), a threshold of a rejection mask): the implementation and the
loop can land on opposite sides of one by a rounding error. The implementation takes one side
(``torch.where``, never ``torch.maximum``'s half-and-half split of a tie); a reference within rounding
of a kink (``near``) lists every side's value, and the test accepts any one of them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from asyncrl.config import load_config
from asyncrl.errors import UserError

TOL = 1e-6
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAN = float("nan")
DTYPES = [pytest.param(torch.float64, id="float64"), pytest.param(torch.float32, id="float32")]
# float32: ~1e-7 relative rounding per operation, a few dozen operations in a reference comparison
_RTOL = {torch.float64: TOL, torch.float32: 1e-4}
_ATOL = {torch.float64: TOL, torch.float32: 1e-5}
# how close two quantities must be for a reference to treat them as a tie (a kink): a few ulps of
# the dtype, times the exp / sums in between (float64 ulp 2e-16, float32 ulp 1.2e-7)
_TIE = {torch.float64: 1e-9, torch.float32: 1e-5}


def close(a: float, b: float, tol: float = TOL, dtype: torch.dtype = torch.float64) -> bool:
    """|a - b| within tol (absolute and relative) in float64; rtol 1e-4 / atol 1e-5 in float32."""
    if dtype == torch.float32:
        return abs(a - b) <= _ATOL[dtype] + _RTOL[dtype] * max(abs(a), abs(b))
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


def near(a: float, b: float, dtype: torch.dtype = torch.float64) -> bool:
    """a and b are equal up to rounding: a decision between them may go either way."""
    return abs(a - b) <= _TIE[dtype] * max(1.0, abs(a), abs(b))


def tols(dtype: torch.dtype) -> dict[str, float]:
    """rtol / atol for torch.allclose in this dtype."""
    return {"rtol": _RTOL[dtype], "atol": _ATOL[dtype]}


def rounded(x, dtype: torch.dtype):
    """An array (or None) rounded to dtype and back to float64: what a float32 learner really holds."""
    if x is None or dtype == torch.float64:
        return x
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def floats(lo: float, hi: float):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, width=64)


def config_accepts(fields: dict) -> bool:
    try:
        load_config(None, {f"algorithm.{k}": v for k, v in fields.items()})
    except UserError:
        return False
    return True
