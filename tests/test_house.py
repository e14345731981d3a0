"""House rules a machine can check (issue 10): small product modules, and no product symbol that only
tests use (a test gets its seam through a subclass or helper in the test files, not through the product).
"""

from __future__ import annotations

import ast
import collections
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = [p for d in ("asyncrl", "generators", "learners", "buffers") for p in sorted((ROOT / d).rglob("*.py"))]
SCRIPTS = sorted((ROOT / "scripts").rglob("*.py"))
TESTS = sorted((ROOT / "tests").rglob("*.py"))
MAX_LINES = 500  # STYLE.md: aim under 400, cap about 800; this project caps at 500
# Called by a framework, not by name: torch's Module.__call__ runs ``forward``.
FRAMEWORK_HOOKS = {"forward"}


def _names(paths: list[Path]) -> collections.Counter:
    """Identifier tokens (comments and strings excluded) in ``paths``."""
    counts: collections.Counter = collections.Counter()
    for path in paths:
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.NAME:
                counts[tok.string] += 1
    return counts


def _definitions() -> list[tuple[Path, str]]:
    out = []
    for path in PRODUCT:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if not node.name.startswith("__") and node.name not in FRAMEWORK_HOOKS:
                    out.append((path, node.name))
    return out


def test_no_product_module_is_over_the_cap():
    long = {str(p.relative_to(ROOT)): n for p in PRODUCT if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these along their seams: {long}"


def test_no_product_symbol_is_used_only_by_tests():
    """A function, class or method whose name appears (outside its own definitions) in tests but nowhere in
    the product or scripts. Names are compared as identifiers, so this errs on the side of passing: a name
    that some other product code happens to use too is not flagged."""
    defs = _definitions()
    defined = collections.Counter(name for _, name in defs)
    used = _names(PRODUCT + SCRIPTS)
    in_tests = _names(TESTS)
    only_tests = sorted(
        {f"{p.relative_to(ROOT)}:{name}" for p, name in defs if used[name] <= defined[name] and in_tests[name] > 0}
    )
    assert not only_tests, f"product symbols used only by tests: {only_tests}"
