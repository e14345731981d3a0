"""The suite's time, split into the tests an older tree had and the tests added since (issue 24's line 2).

The suite grows with every feature, so its total time compares nothing with a tree that had fewer tests.
This reads a JUnit report of a run of the suite (pytest ``--junitxml``) and sums the time of the test cases
whose function already existed at a git revision (by name: a test moved to another file or folder still
counts as the old one; a test renamed is counted as new), and of the rest:

    .venv/bin/python -m pytest -m 'not gpu' -q -p no:cacheprovider --junitxml=/tmp/suite.xml
    .venv/bin/python scripts/bench/suite.py /tmp/suite.xml --base 16497d1
    RESULT old_tests_seconds <s>   # the cases of functions the base had (fixtures' set-up included)
    RESULT new_tests_seconds <s>

Time between test cases (collection, session fixtures' start-up) is in neither: the report's total is
printed beside them.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_DEF = re.compile(r"^\s*(?:async\s+)?def\s+(test_\w+)", re.MULTILINE)


def test_names(rev: str) -> set[str]:
    """The names of every test function under ``tests/`` at ``rev``."""
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev, "tests"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    names: set[str] = set()
    for path in (f for f in files if Path(f).name.startswith("test_") and f.endswith(".py")):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True).stdout
        names.update(TEST_DEF.findall(text))
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path, help="pytest --junitxml output of a run of the suite")
    ap.add_argument("--base", required=True, help="the git revision whose tests count as old (e.g. 16497d1)")
    args = ap.parse_args()
    old = test_names(args.base)
    root = ET.parse(args.report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    seconds = {"old": 0.0, "new": 0.0}
    cases = {"old": 0, "new": 0}
    for case in root.iter("testcase"):
        function = case.get("name", "").split("[", 1)[0]
        which = "old" if function in old else "new"
        seconds[which] += float(case.get("time", 0.0))
        cases[which] += 1
    total = sum(float(s.get("time", 0.0)) for s in suites)
    print(f"report: {sum(cases.values())} cases in {total:.1f} s; the base ({args.base}) had {len(old)} test functions")
    for which in ("old", "new"):
        print(f"RESULT {which}_tests_seconds {seconds[which]:.1f}  ({cases[which]} cases)")


if __name__ == "__main__":
    main()
