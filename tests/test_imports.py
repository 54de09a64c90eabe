"""The import rules of docs/ARCHITECTURE.md ("Layers", "Import rules"), checked on the source with `ast`:
nothing of mpitrain (nor torch) is imported, and the tree is parsed once: about a second.

What counts as an import of module B by module A (every one counts the same for every rule):
- ``import B`` / ``from B import name`` (``from P import b`` where ``P.b`` is a module imports ``P.b``),
  at module level, under ``if TYPE_CHECKING:`` or inside a function (a lazy import);
- a string constant that names a module, ``"mpitrain.x.y"`` or ``"mpitrain.x.y:attr"`` (a by-name table
  loaded with importlib: fit's strategy table, the package's lazy names).
A lazy, type-only or by-name import hides a circle or an upward step from the interpreter, not from the
design: A still needs B. Importing ``P.Q.m`` also runs the ``__init__`` of P and P.Q, so for circles an
import of ``P.Q.m`` is also an import of every package above ``m`` that is not already above A.

The rules, each failure naming the file, the line and the rule:
(a) no circle among modules;
(b) no upward import: a module imports only its own layer and the layers below it, by the layer table of
    docs/ARCHITECTURE.md (the first column of the code block under "## Layers", top to bottom; parsed here,
    so the doc and the test cannot drift), and every module is in some layer;
(c) no private module of another package: ``P._x`` (a module or package whose name starts with one
    underscore) is imported only from P itself and P's subpackages (``mpitrain._utils`` serves all of
    mpitrain; ``mpitrain.comm._mpi`` serves comm alone: others use what ``mpitrain.comm`` exports).
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "mpitrain"
DOC = ROOT / "docs" / "ARCHITECTURE.md"

#: Imports the rules skip, (importer, imported) -> why. Each is a known case with an owner; an entry that no
#: longer matches an import fails the test, so this list only shrinks.
ALLOWED: dict[tuple[str, str], str] = {
}


@dataclass(frozen=True)
class Import:
    """One reference from `importer` (defined in `path`, at `line`) to module `target`."""

    importer: str
    target: str
    path: Path
    line: int
    kind: str  # "module level" | "TYPE_CHECKING" | "lazy" | "by name"

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} ({self.kind} import of {self.target})"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


_BY_NAME = re.compile(rf"^({PACKAGE}(?:\.\w+)*)(?::\w+)?$")


def _targets(node: ast.Import | ast.ImportFrom, package: str, known: dict[str, Path]) -> list[str]:
    """The modules `node` imports (``from P import name``: ``P.name`` where that is a module, else P)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = package
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    source = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, source: str, known: dict[str, Path]) -> list[Import]:
    """Every reference from module `name` (`source`, read from `path`) to another module of the package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = kind
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                here = "lazy"
            elif isinstance(child, ast.If) and kind == "module level" and _is_type_checking(child.test):
                for sub in child.body:
                    visit_one(sub, "TYPE_CHECKING")
                for sub in child.orelse:
                    visit_one(sub, kind)
                continue
            visit_one(child, here)

    def visit_one(child: ast.AST, kind: str) -> None:
        if isinstance(child, ast.Import | ast.ImportFrom):
            for target in _targets(child, package, known):
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    found.append(Import(name, target, path, child.lineno, kind))
        elif isinstance(child, ast.Constant) and isinstance(child.value, str):
            m = _BY_NAME.match(child.value)
            # a module's own package named by string is a label (a logger's name), never a load: it is loaded
            if m and m.group(1) in known and not (name == m.group(1) or name.startswith(m.group(1) + ".")):
                found.append(Import(name, m.group(1), path, child.lineno, "by name"))
        visit(child, kind)

    visit(ast.parse(source, str(path)), "module level")
    return found


@functools.cache
def all_imports() -> tuple[Import, ...]:
    """Every import in src/mpitrain, one per (importer, target, line); parsed once per test session."""
    known = modules()
    found = {(i.importer, i.target, i.line): i for name, path in known.items()
             for i in imports_of(name, path, path.read_text(), known)}
    return tuple(found.values())


def checked_imports() -> list[Import]:
    return [imp for imp in all_imports() if (imp.importer, imp.target) not in ALLOWED]


# -- (b) the layer table -------------------------------------------------------------------------------------------
_MEMBER = re.compile(r"^(?:\w+/)*(?:\w+\.py|\w+/)$")


def layer_table(doc: str) -> list[list[str]]:
    """The layers of docs/ARCHITECTURE.md, top first: each a list of members, ``x.py`` (the module
    mpitrain.x; ``__init__.py`` is mpitrain itself) or ``x/`` (the package mpitrain.x and all below it)."""
    section = doc.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    layers = []
    for line in block.splitlines()[1:]:
        if not line or line[0].isspace():
            continue  # a description's continuation
        first = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        members = [m.strip() for m in first.split(",")]
        bad = [m for m in members if not _MEMBER.match(m)]
        assert not bad, f"{DOC.relative_to(ROOT)}: layer line {line!r}: {bad} is not 'name.py' or 'name/'"
        layers.append(members)
    return layers


def _member_module(member: str) -> str:
    if member.endswith("/"):
        return ".".join([PACKAGE, *member.rstrip("/").split("/")])
    path = member[: -len(".py")].split("/")
    return ".".join([PACKAGE, *path[:-1]] + ([] if path[-1] == "__init__" else [path[-1]]))


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """The index (0 = top) of the layer whose most specific member holds `module`."""
    best: tuple[int, int] | None = None  # (specificity, layer)
    for index, members in enumerate(layers):
        for member in members:
            prefix = _member_module(member)
            holds = module == prefix or (member.endswith("/") and module.startswith(prefix + "."))
            if holds and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def upward_imports(imports: list[Import], layers: list[list[str]]) -> list[str]:
    failures = []
    for imp in imports:
        low, high = layer_of(imp.importer, layers), layer_of(imp.target, layers)
        if low is not None and high is not None and high < low:
            failures.append(f"{imp.where()}: upward import: layer {low + 1} {layers[low]} imports layer "
                            f"{high + 1} {layers[high]} (docs/ARCHITECTURE.md, Layers)")
    return failures


# -- (c) private modules --------------------------------------------------------------------------------------------
def private_owner(module: str) -> str | None:
    """The package a private module belongs to (``a.b._x.y`` -> ``a.b``), None for a public module."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def package_of(module: str, known: dict[str, Path]) -> str:
    return module if known[module].name == "__init__.py" else module.rpartition(".")[0]


def private_imports(imports: list[Import], known: dict[str, Path]) -> list[str]:
    failures = []
    for imp in imports:
        owner = private_owner(imp.target)
        here = package_of(imp.importer, known)
        if owner is not None and not (here == owner or here.startswith(owner + ".")):
            failures.append(f"{imp.where()}: private module of package {owner} imported from package {here} "
                            f"(import what {owner} exports, or move the concept down)")
    return failures


# -- (a) circles ----------------------------------------------------------------------------------------------------
def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(imports: list[Import]) -> dict[str, dict[str, Import]]:
    """importer -> {imported: the first import that makes the edge}, with the packages an import initialises."""
    graph: dict[str, dict[str, Import]] = defaultdict(dict)
    for imp in imports:
        own = set(_ancestors(imp.importer))
        for target in [imp.target, *(a for a in _ancestors(imp.target) if a not in own)]:
            if target != imp.importer:
                graph[imp.importer].setdefault(target, imp)
    return graph


def circles(graph: dict[str, dict[str, Import]]) -> list[tuple[list[str], list[Import]]]:
    """Each strongly connected component of more than one module (Tarjan), with one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [(sorted(c), _cycle_in(sorted(c)[0], c, graph)) for c in components]


def _cycle_in(start: str, component: set[str], graph: dict[str, dict[str, Import]]) -> list[Import]:
    """A shortest cycle through `start` inside `component` (breadth first)."""
    parent: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w, imp in sorted(graph[v].items()):
                if w not in component or w in parent:
                    continue
                parent[w] = imp
                if w == start:
                    cycle = [imp]
                    while cycle[0].importer != start:
                        cycle.insert(0, parent[cycle[0].importer])
                    return cycle
                following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # cannot happen in a strongly connected component


# -- the tests ------------------------------------------------------------------------------------------------------
def test_the_import_parser_sees_every_kind_of_import() -> None:
    """The walker finds module-level, TYPE_CHECKING, lazy and by-name imports, relative ones resolved."""
    source = ("from typing import TYPE_CHECKING\nfrom ..comm import base\nfrom .._utils.stall import poll\n"
              "if TYPE_CHECKING:\n    from ..fit import fit\n"
              "def f():\n    import mpitrain.planner._plan\n"
              "TABLE = {'x': 'mpitrain.spatial.trainer:make_trainer', 'doc': 'mpitrain.fit is a function'}\n")
    path = SRC / PACKAGE / "strategies" / "probe.py"  # never written: only `source` is parsed
    known = {**modules(), "mpitrain.strategies.probe": path}  # a copy: modules() is cached
    found = {(i.target, i.kind) for i in imports_of("mpitrain.strategies.probe", path, source, known)}
    assert found == {("mpitrain.comm.base", "module level"), ("mpitrain._utils.stall", "module level"),
                     ("mpitrain.fit", "TYPE_CHECKING"), ("mpitrain.planner._plan", "lazy"),
                     ("mpitrain.spatial.trainer", "by name")}


def test_the_rules_catch_a_circle_an_upward_import_and_a_private_module() -> None:
    """Each rule fails on a made-up violation (so a clean run means something)."""
    known = modules()
    p = SRC / PACKAGE / "x.py"
    up = Import("mpitrain.comm.base", "mpitrain.fit", p, 1, "lazy")
    private = Import("mpitrain.fit", "mpitrain.comm._mpi", p, 2, "module level")
    back = Import("mpitrain.fit", "mpitrain.comm.base", p, 3, "module level")
    layers = layer_table(DOC.read_text())
    assert len(upward_imports([up], layers)) == 1 and not upward_imports([back], layers)
    assert len(private_imports([private], known)) == 1 and not private_imports([back], known)
    assert [len(cycle) for _, cycle in circles(import_graph([up, back]))] == [2]


def test_every_module_is_in_a_layer_of_the_architecture_doc() -> None:
    layers = layer_table(DOC.read_text())
    missing = [m for m in modules() if layer_of(m, layers) is None]
    assert not missing, f"modules in no layer of {DOC.relative_to(ROOT)} (## Layers): {missing}"


def test_no_import_goes_up_a_layer() -> None:
    failures = upward_imports(checked_imports(), layer_table(DOC.read_text()))
    assert not failures, "\n".join(failures)


def test_no_private_module_is_imported_from_another_package() -> None:
    failures = private_imports(checked_imports(), modules())
    assert not failures, "\n".join(failures)


def test_no_import_circle() -> None:
    found = circles(import_graph(checked_imports()))
    failures = [f"import circle among {members} (docs/ARCHITECTURE.md, Import rules), e.g.:\n    "
                + "\n    ".join(i.where() for i in cycle) for members, cycle in found]
    assert not failures, "\n".join(failures)


def test_every_allowed_import_still_exists() -> None:
    """The allowlist only shrinks: an entry whose import is gone must be deleted."""
    present = {(i.importer, i.target) for i in all_imports()}
    stale = [f"{edge}: {why}" for edge, why in ALLOWED.items() if edge not in present]
    assert not stale, "tests/test_imports.py ALLOWED names imports that no longer exist; delete them:\n" + \
        "\n".join(stale)
