"""House rules a machine can check (issue 10): small product modules, and no product symbol that only
tests use (a test gets its seam through a subclass or helper in the test files, not through the product).
"""

from __future__ import annotations

import ast
import collections
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


# ----- the package import rule ---------------------------------------------------------------------
# asyncrl's top-level modules and asyncrl.config are the core; every other package (the three role folders
# included) is a wing whose __init__ docstring ends with the line "May import: the core, asyncrl.X, ...".
SOURCE_OF = {"generators": ROOT / "generators", "learners": ROOT / "learners", "buffers": ROOT / "buffers"}
CORE_PACKAGES = {"config", "data"}
TOP_LEVEL_CAP = 12  # modules beside __init__.py in asyncrl/ (issue 24: the flat drawer of 40 became packages)


def _unit_dir(unit: str) -> Path:
    return SOURCE_OF.get(unit, ROOT / "asyncrl" / unit)


def _units() -> tuple[set[str], set[str]]:
    """(core units, wings): top-level modules and core packages; every other package."""
    core = {p.stem for p in (ROOT / "asyncrl").glob("*.py") if p.stem != "__init__"} | CORE_PACKAGES
    wings = {p.parent.name for p in (ROOT / "asyncrl").glob("*/__init__.py")} - CORE_PACKAGES
    return core, wings | set(SOURCE_OF)


def _unit_files(unit: str) -> list[Path]:
    path = _unit_dir(unit)
    return sorted(path.rglob("*.py")) if path.is_dir() else [ROOT / "asyncrl" / f"{unit}.py"]


def _imported_units(path: Path, units: set[str]) -> dict[str, int]:
    """asyncrl units that ``path`` imports (lazy imports inside functions count; imports under
    ``if TYPE_CHECKING:`` do not, since they never run) -> the first line that does."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "asyncrl":  # from asyncrl import buffers
                names += [f"asyncrl.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "asyncrl" and len(parts) > 1 and parts[1] in units:
                found.setdefault(parts[1], node.lineno)
    return found


def _graph() -> dict[str, dict[str, str]]:
    """unit -> {imported unit: 'file:line' of the first import}."""
    core, wings = _units()
    units = core | wings
    graph: dict[str, dict[str, str]] = {}
    for unit in sorted(units):
        edges: dict[str, str] = {}
        for path in _unit_files(unit):
            for other, line in _imported_units(path, units).items():
                if other != unit:
                    edges.setdefault(other, f"{path.relative_to(ROOT)}:{line}")
        graph[unit] = edges
    return graph


def _may_import(unit: str) -> set[str]:
    doc = ast.get_docstring(ast.parse((_unit_dir(unit) / "__init__.py").read_text())) or ""
    lines = doc.split("May import:")
    assert len(lines) == 2, f"{unit}/__init__.py: its docstring must end with one 'May import: ...' line"
    allowed = set()
    for item in lines[1].replace("\n", " ").rstrip(". ").split(","):
        item = item.strip().rstrip(".").split(" (")[0]
        allowed.add("the core" if item == "the core" else item.removeprefix("asyncrl."))
    return allowed


def test_asyncrl_top_level_holds_the_core_only():
    modules = sorted(p.name for p in (ROOT / "asyncrl").glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= TOP_LEVEL_CAP, f"{len(modules)} modules at asyncrl/'s top level: {modules}"


def test_every_package_names_its_concern_and_what_it_may_import():
    core, wings = _units()
    for unit in sorted(wings | CORE_PACKAGES):
        doc = ast.get_docstring(ast.parse((_unit_dir(unit) / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 10, f"{unit}/__init__.py must say what lives there"
    for unit in sorted(wings):
        unknown = _may_import(unit) - wings - {"the core"}
        assert not unknown, f"{unit}: 'May import' names no such package: {sorted(unknown)}"


def test_the_core_imports_no_wing():
    """cli is the front door: it dispatches to every wing (lazily), so it alone is exempt."""
    core, wings = _units()
    graph = _graph()
    bad = {u: {w: at for w, at in graph[u].items() if w in wings} for u in sorted(core - {"cli"})}
    assert not {u: e for u, e in bad.items() if e}, f"core units importing wings: {bad}"


def test_every_wing_imports_only_what_its_docstring_allows():
    core, wings = _units()
    graph = _graph()
    bad = {}
    for unit in sorted(wings):
        allowed = _may_import(unit)
        extra = {w: at for w, at in graph[unit].items() if w in wings and w not in allowed}
        if "the core" not in allowed:
            extra |= {c: at for c, at in graph[unit].items() if c in core}
        if extra:
            bad[unit] = extra
    assert not bad, f"imports the package docstrings do not allow: {bad}"


def test_no_import_circle_between_units():
    graph = _graph()
    done: set[str] = set()

    def visit(unit: str, trail: list[str]) -> list[str] | None:
        if unit in trail:
            return trail[trail.index(unit) :] + [unit]
        if unit in done:
            return None
        for other in sorted(graph.get(unit, {})):
            if other != "cli" and (circle := visit(other, trail + [unit])):
                return circle
        done.add(unit)
        return None

    for unit in sorted(graph):
        circle = visit(unit, [])
        assert circle is None, "import circle: " + " -> ".join(
            f"{a} ({graph[a][b]})" for a, b in zip(circle, circle[1:], strict=False)
        )


# ----- no import circle between product files -----------------------------------------------------
# A circle between two files works only while every import on it but one stays lazy (inside a function), and
# which one imports first decides what the other sees half-built. The unit rule above cannot see one within a
# package: this one does, file by file.


def _module_name(path: Path) -> str:
    """``asyncrl.generators.engine`` for generators/engine.py; a package's ``__init__.py`` is the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in SOURCE_OF:
        parts.insert(0, "asyncrl")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree`` at any depth (inside functions, under try), except those in the body
    of an ``if TYPE_CHECKING:``, which never run."""
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in typing_only]


def _imported_modules(node: ast.Import | ast.ImportFrom, package: str, modules: set[str]) -> set[str]:
    """The product modules an import statement in ``package`` imports: ``import a.b.c`` the module a.b.c (the
    longest prefix that is one: its packages' ``__init__`` are not counted); ``from m import x`` m.x where that
    is a module, else m."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the package, one level up per dot after the first
            up = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(up + ([node.module] if node.module else []))
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
        names = subs if len(subs) == len(node.names) else [*subs, base]
    found = set()
    for name in names:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        if parts:
            found.add(".".join(parts))
    return found


def _file_graph() -> dict[Path, dict[Path, int]]:
    """product file -> {product file it imports: the first line that does}."""
    files = {_module_name(p): p for p in PRODUCT}
    graph: dict[Path, dict[Path, int]] = {}
    for path in PRODUCT:
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: dict[Path, int] = {}
        for node in sorted(runtime_imports(ast.parse(path.read_text())), key=lambda n: n.lineno):
            for other in _imported_modules(node, package, set(files)):
                edges.setdefault(files[other], node.lineno)
        graph[path] = edges
    return graph


def _strongly_connected(graph: dict[Path, dict[Path, int]]) -> list[list[Path]]:
    """Tarjan's strongly connected components of ``graph``, each sorted."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    components: list[list[Path]] = []

    def visit(v: Path) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_no_import_circle_between_product_files():
    """No product file imports itself, or another that leads back to it, counting lazy imports (the usual
    culprit: a factory in the interface's module importing the implementations, which import the interface;
    ``asyncrl.buffers`` and ``asyncrl.weights`` keep theirs in the package's ``__init__``)."""
    graph = _file_graph()
    circles = [c for c in _strongly_connected(graph) if len(c) > 1 or c[0] in graph[c[0]]]
    report = [
        ", ".join(str(p.relative_to(ROOT)) for p in c)
        + ": "
        + "; ".join(
            f"{a.relative_to(ROOT)}:{graph[a][b]} imports {b.relative_to(ROOT)}" for a in c for b in c if b in graph[a]
        )
        for c in circles
    ]
    assert not circles, "import circles between product files:\n" + "\n".join(report)


# ----- no private member used across product modules ---------------------------------------------
# A leading underscore says "this module's own business": a module that reaches into another's (``pool._ids``,
# ``from asyncrl.rewards.remote import _error_text``) couples to what its owner may change without notice.
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}  # public API despite the underscore


def _own_names(tree: ast.Module) -> set[str]:
    """Every name ``tree`` defines or binds: functions, classes, assigned names and attributes, imports."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in NAMEDTUPLE_API


def test_no_private_member_is_used_across_product_modules():
    """``x._name`` (x neither ``self``, ``cls`` nor ``super()``) where ``_name`` is defined by another product
    module and not by this one, and ``from asyncrl... import _name``."""
    trees = {path: ast.parse(path.read_text()) for path in PRODUCT}
    own = {path: _own_names(tree) for path, tree in trees.items()}
    defined_by: dict[str, set[Path]] = collections.defaultdict(set)
    for path, names in own.items():
        for name in names:
            defined_by[name].add(path)
    bad = []
    for path, tree in trees.items():
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("asyncrl"):
                bad += [
                    f"{where}:{node.lineno} imports {node.module}.{a.name}" for a in node.names if _is_private(a.name)
                ]
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)) or node.attr in own[path]:
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            if others := defined_by[node.attr] - {path}:
                bad.append(
                    f"{where}:{node.lineno} uses .{node.attr} of {sorted(str(o.relative_to(ROOT)) for o in others)[0]}"
                )
    assert not bad, "private members used across modules:\n" + "\n".join(sorted(bad))


# ----- paths named in text ------------------------------------------------------------------------
NAMED_PATH = re.compile(
    r"(?<![\w./-])((?:asyncrl|generators|learners|buffers|tests|scripts|configs|docs|data)/[\w./-]*"
    r"\.(?:py|md|yaml|sh|jsonl|lua))"
)


def test_every_repository_path_named_in_code_and_docs_exists():
    """A docstring, comment or page that names a file the reorganisation moved points nowhere: every
    ``dir/.../file.ext`` of this repository that the code, the scripts, the tests or the docs name exists."""
    texts = [*PRODUCT, *SCRIPTS, *TESTS, ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = sorted(
        f"{m.group(1)} (named in {path.relative_to(ROOT)})"
        for path in texts
        for m in NAMED_PATH.finditer(path.read_text())
        if not (ROOT / m.group(1)).exists()
    )
    assert not missing, f"paths that do not exist: {missing}"
