"""The README is a front door and docs/ a site that builds (issue 24): README.md at most 250 lines with
the two commands before any other section, every link of it resolving, ``mkdocs build --strict`` with no
warning (a broken link or anchor, a page left out of the navigation, a stale configuration reference: the
site's hook), and every repository path and module the pages name existing after the package move (test_house
checks plain file paths everywhere; here also folders, globs, brace lists and dotted module names)."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from services import in_ci

from asyncrl import MOVED_MODULES

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 250
TWO_COMMANDS = (
    "bash scripts/setup.sh && .venv/bin/asyncrl launch --config configs/demo-cpu.yaml --generators 2 --learners 2",
    'bash scripts/setup.sh && .venv/bin/python -m pytest -m "not gpu"',
)
# the repository's own folders: a path in the pages that starts with one of them must exist
TOP = ("asyncrl", "generators", "learners", "buffers", "tests", "scripts", "configs", "data", "docs")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP) + r")/[\w./*{},<>-]*)")
MODULE = re.compile(r"(?<![\w/.])(asyncrl(?:\.\w+)+)")
# wire schema names (asyncrl/protocol.py, asyncrl/rewards/remote.py, asyncrl/episodes/remote_env.py)
SCHEMAS = {"asyncrl.traj", "asyncrl.reward", "asyncrl.env", "asyncrl.agent"}
ROLES = {"asyncrl.generators": "generators", "asyncrl.learners": "learners", "asyncrl.buffers": "buffers"}


def _sections(text: str) -> list[str]:
    """The level-2 headings of a markdown text, outside fenced code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.findall(r"^## (.+)$", text, flags=re.M)


def test_readme_is_a_front_door_with_the_two_commands_first():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES, "README.md is the front door: the rest goes to docs/"
    assert _sections(text)[0] == "The two commands"
    first = text.index("## The two commands")
    section = text[first : text.index("\n## ", first + 1)]
    for command in TWO_COMMANDS:  # CI (.ci/run) and a hook run the test command as the README writes it
        assert command in section


def test_every_link_of_the_readme_resolves():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the README links into docs/"
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_the_docs_site_builds_with_no_warning(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        msg = "mkdocs or mkdocs-material missing: pip install -e '.[docs]' (scripts/setup.sh does)"
        if in_ci():
            pytest.fail(msg + "; CI=true, so this is a failure, not a skip")
        pytest.skip(msg)
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,  # the snippets' base path (README.md) and the hook's path are the repository root
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "WARNING" not in out, out
    for page in PAGES:
        name = "" if page.stem == "index" else page.stem + "/"
        assert (tmp_path / "site" / name / "index.html").exists(), f"{page.name} did not become a page"
    home = (tmp_path / "site" / "index.html").read_text()
    assert "XREADGROUP" in home and "AdvantageName" in home, "the home page takes the README's picture and map"


def _expand(path: str) -> list[str]:
    """``learners/{kl,corrections}.py`` -> both paths."""
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in _expand(path[: m.start()] + alt + path[m.end() :])]


def _module_exists(dotted: str) -> bool:
    """``asyncrl.a.b[.attr...]`` names a module or package of this repository (an attribute may follow)."""
    parts = dotted.split(".")
    for i in range(len(parts), 1, -1):
        mod = ".".join(parts[:i])
        base = next((folder + mod[len(k) :] for k, folder in ROLES.items() if mod == k or mod.startswith(k + ".")), mod)
        base = base.replace(".", "/")
        if (ROOT / f"{base}.py").exists() or (ROOT / base / "__init__.py").exists():
            return len(parts) - i <= 1  # at most one attribute after the module
    return False


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_path_and_module_the_docs_name_exists(page):
    missing = []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        for match in PATH.finditer(line):
            path = match.group(1).rstrip(".,:;)")
            if "<" not in path:  # runs/<name>/... style placeholders are not paths
                missing += [f"{page.name}:{n}: {p}" for p in _expand(path) if not glob.glob(str(ROOT / p))]
        for match in MODULE.finditer(line):
            dotted = match.group(1)
            if dotted in SCHEMAS:
                continue
            if dotted in MOVED_MODULES and MOVED_MODULES[dotted] in line:
                continue  # an old path named beside its new one
            if not _module_exists(dotted):
                missing.append(f"{page.name}:{n}: {dotted}")
    assert missing == [], "paths or modules that do not exist (moved? see asyncrl.MOVED_MODULES)"
