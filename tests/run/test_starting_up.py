"""A process's set-up without the garbage collector's automatic passes (``asyncrl.lifetime.starting_up``), in a
fresh interpreter each: the context freezes the heap, which a test process should not have done to it."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json, weakref
from asyncrl.lifetime import starting_up

class Node:
    pass

def passes():
    return sum(s["collections"] for s in gc.get_stats())

if {disabled_before}:
    gc.disable()
before, out = passes(), {{}}
try:
    with starting_up():
        out["enabled_inside"] = gc.isenabled()
        node = Node()
        node.me = node  # a cycle: only a collection frees it
        dead = weakref.ref(node)
        del node
        kept = [[] for _ in range(50_000)]  # tracked containers: ~70 automatic passes with the collector on
        out["passes_inside"] = passes() - before
        out["cycle_alive_inside"] = dead() is not None
        if {fail}:
            raise RuntimeError("set-up failed")
except RuntimeError:
    out["raised"] = True
out["enabled_after"] = gc.isenabled()
out["cycle_alive_after"] = dead() is not None
out["frozen"] = gc.get_freeze_count()
print(json.dumps(out))
"""


def _probe(disabled_before: bool = False, fail: bool = False) -> dict:
    code = PROBE.format(disabled_before=disabled_before, fail=fail)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_set_up_runs_without_automatic_passes_then_one_collection_frees_its_cycles_and_the_rest_is_frozen():
    out = _probe()
    assert out["enabled_inside"] is False
    assert out["passes_inside"] == 0
    assert out["cycle_alive_inside"] is True
    assert out["enabled_after"] is True
    assert out["cycle_alive_after"] is False, "the collection at the end of set-up frees what it left in cycles"
    assert out["frozen"] > 50_000, "the survivors (the kept containers among them) are out of later passes"


def test_a_collector_switched_off_before_stays_off():
    out = _probe(disabled_before=True)
    assert out["enabled_after"] is False
    assert out["cycle_alive_after"] is False


def test_a_failed_set_up_gives_the_collector_back_and_freezes_nothing():
    out = _probe(fail=True)
    assert out["raised"] is True
    assert out["enabled_after"] is True
    assert out["frozen"] == 0
