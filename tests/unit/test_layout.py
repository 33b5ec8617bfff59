"""The package's layout: no import cycle among its modules, and no module over 450 lines.

The cycle check reads every module of ``lightning_zero`` with ``ast`` and follows the imports that run when the
module is imported: those at module level, including under ``try``/``if`` blocks other than ``if TYPE_CHECKING:``,
but not those inside functions or classes' methods. ``from package import name`` where ``name`` is a submodule
counts as importing that submodule (and the package's ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_zero

PACKAGE_DIR = Path(lightning_zero.__file__).resolve().parent
PACKAGE = "lightning_zero"
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    if isinstance(test, ast.Attribute):
        return test.attr == "TYPE_CHECKING"
    return False


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run on import: not in functions or classes, not under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(statements: list[ast.stmt]) -> None:
        for statement in statements:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                found.append(statement)
            elif isinstance(statement, ast.If):
                if not _is_type_checking(statement.test):
                    visit(statement.body)
                visit(statement.orelse)
            elif isinstance(statement, ast.Try):
                visit(statement.body)
                for handler in statement.handlers:
                    visit(handler.body)
                visit(statement.orelse)
                visit(statement.finalbody)
            elif isinstance(statement, (ast.With, ast.For, ast.While)):
                visit(statement.body)

    visit(tree.body)
    return found


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _with_parents(name: str, modules: dict[str, Path]) -> set[str]:
    """``name`` and the packages above it that importing it runs (their ``__init__``), within lightning_zero."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        # Names taken from a package above this one (``from lightning_zero import ZeroConfig``): that package is
        # mid-import when this module runs, so such an import depends on it like on any other module.
        from_ancestor: set[str] = set()
        for statement in _module_level_imports(tree):
            if isinstance(statement, ast.Import):
                for alias in statement.names:
                    if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                        edges |= _with_parents(alias.name, modules)
                continue
            target = statement.module
            if statement.level:
                target = _resolve_relative(name, is_package, statement.level, statement.module)
            if target is None or not (target == PACKAGE or target.startswith(PACKAGE + ".")):
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


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = grey
        stack.append(node)
        for succ in sorted(graph.get(node, ())):
            if colour.get(succ, black) == grey:
                return stack[stack.index(succ) :] + [succ]
            if colour.get(succ) == white:
                cycle = visit(succ)
                if cycle:
                    return cycle
        stack.pop()
        colour[node] = black
        return None

    for node in sorted(graph):
        if colour[node] == white:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_reports_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "lightning_zero.strategy" in graph
    assert "lightning_zero.config" in graph["lightning_zero.strategy"]


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle at module level: " + " -> ".join(cycle or [])


def test_no_module_over_450_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE_DIR.parent)): count
        for path in PACKAGE_DIR.rglob("*.py")
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"
