"""The package's layout: no import cycle among its modules, and no module over 450 lines.

The cycle check reads every module of ``lightning_zero`` with ``ast`` and follows every import in it: at module level
(under ``try``/``if`` blocks too), inside functions and methods, and under ``if TYPE_CHECKING:``. A function-level
import runs later than a module-level one, and a ``TYPE_CHECKING`` one never, but each is an arrow between two
modules all the same, and a circle of arrows is how two concerns end up as one (STYLE.md: "no circle even through
function-level imports"). ``from package import name`` where ``name`` is a submodule counts as importing that
submodule (and the package's ``__init__``). The circles that exist are listed in ``KNOWN_CYCLES``, each with why it
is still there: a new one, or a known one that grows, fails; one that is gone must be struck from the list.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_zero

PACKAGE_DIR = Path(lightning_zero.__file__).resolve().parent
PACKAGE = "lightning_zero"
MAX_LINES = 450

#: The import cycles lightning_zero has, each a strongly connected component of the import graph, and why it is still
#: there (issue 56 restructures the packages). Not one is a cycle at module level: each closes through an import
#: under ``if TYPE_CHECKING:`` or inside a function.
KNOWN_CYCLES: list[frozenset[str]] = [
    # collectives.py imports the in-flight handles (in_flight.py), the node-by-node second stages (by_node.py) and
    # its quantized half (quantized_collectives.py) at module level; in_flight.py and by_node.py name ``Collectives``
    # in annotations only (under TYPE_CHECKING), and quantized_collectives.py reaches it through in_flight.py.
    frozenset({
        "lightning_zero.sharding.by_node", "lightning_zero.sharding.collectives", "lightning_zero.sharding.in_flight",
        "lightning_zero.sharding.quantized_collectives",
    }),
]


def _module_name(path: Path, package_dir: Path = PACKAGE_DIR) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module: module level, in functions and methods, under ``if TYPE_CHECKING:``."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _with_parents(name: str, modules: dict[str, Path]) -> set[str]:
    """``name`` and the packages above it that importing it runs (their ``__init__``), within lightning_zero."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules}


def import_graph(package_dir: Path = PACKAGE_DIR, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = {_module_name(path, package_dir): path for path in sorted(package_dir.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        # Names taken from a package above this one (``from lightning_zero import ZeroConfig``): that package is
        # mid-import when this module runs, so such an import depends on it like on any other module.
        from_ancestor: set[str] = set()
        for statement in _imports(tree):
            if isinstance(statement, ast.Import):
                for alias in statement.names:
                    if alias.name == package or alias.name.startswith(package + "."):
                        edges |= _with_parents(alias.name, modules)
                continue
            target = statement.module
            if statement.level:
                target = _resolve_relative(name, is_package, statement.level, statement.module)
            if target is None or not (target == package or target.startswith(package + ".")):
                continue
            edges |= _with_parents(target, modules)
            for alias in statement.names:
                submodule = f"{target}.{alias.name}"
                if submodule in modules:
                    edges |= _with_parents(submodule, modules)
                else:
                    from_ancestor.add(target)
        # The packages above a module (and the module itself) are already importing when it runs: an edge to them
        # is no cycle unless it reads a name from them.
        ancestors = _with_parents(name, modules)
        graph[name] = (edges - ancestors) | (from_ancestor & ancestors - {name})
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of ``graph`` that hold a cycle (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in graph:
                continue
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(component) > 1 or node in graph[node]:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found, key=sorted)


def test_cycles_are_the_strongly_connected_components() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"c", "a"}, "d": {"e"}, "e": {"d"}}) == [
        frozenset("ab"), frozenset("c"), frozenset("de")]


def test_import_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "lightning_zero.strategy" in graph
    assert "lightning_zero.config" in graph["lightning_zero.strategy"]


def _described(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    arrows = [f"{a} -> {b}" for a in sorted(component) for b in sorted(graph[a] & component)]
    return "; ".join(arrows)


def test_no_import_cycle_but_the_known_ones() -> None:
    graph = import_graph()
    found = cycles(graph)
    new = [c for c in found if c not in KNOWN_CYCLES]
    assert not new, "import cycle (every import counts, function-level and TYPE_CHECKING ones too): " + " | ".join(
        _described(c, graph) for c in new)
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"no longer a cycle: strike it from KNOWN_CYCLES: {gone}"


def test_function_level_and_type_checking_imports_close_a_cycle(tmp_path: Path) -> None:
    """What the check missed when it read module-level imports only."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from pkg.c import g\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n")
    (package / "d.py").write_text("import pkg.a\n")  # into the cycle, not on it
    graph = import_graph(package, "pkg")
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.b", "pkg.c"})]


def test_no_module_over_450_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE_DIR.parent)): count
        for path in PACKAGE_DIR.rglob("*.py")
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"
