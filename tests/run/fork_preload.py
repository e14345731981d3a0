"""A module the test fork servers import before forking (tests/run/test_forkserver.py)."""

IMPORTED = True
