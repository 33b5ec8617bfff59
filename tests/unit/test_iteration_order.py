"""No loop in lightning_zero follows a set's iteration order (see [Note: how the order of collectives is owned] in
lightning_zero/sharding/collectives.py).

A set of objects hashed by identity (``torch.dtype``, parameters, modules) iterates in address order, and a set of
strings in hash-seed order: both differ between interpreters, so between the ranks of any launcher but fork. A loop
over such a set that issues one collective per element issues them in different orders on different ranks: gloo
aborts, or, where two buckets have the same byte size, swaps their data. The check below parses every module of the
library and fails on a ``for`` loop, comprehension, unpacking or order-keeping call (``list``, ``tuple``,
``enumerate``, ``zip``, ``dict.fromkeys``, ...) over a set: a set display or comprehension, ``set(...)`` or
``frozenset(...)``, a set operation, a name or ``self`` attribute only ever bound to one, or a call of a function of the
same module annotated to return one. ``sorted(...)`` gives an order of its own and is what to write instead (or
``dict.fromkeys(...)`` over the model's order). It sees sets that stay within a module; the distributed runs with ranks
as separate interpreters (tests/integration/test_launchers.py) see the rest.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parents[2] / "lightning_zero"

#: Calls whose result keeps the order of what they are given.
ORDER_KEEPING = {"list", "tuple", "enumerate", "zip", "reversed", "iter", "next", "fromkeys", "extend", "join", "map",
                 "filter"}
#: Calls whose result has no order, or one of its own.
ORDER_FREE = {"sorted", "set", "frozenset", "len", "any", "all", "min", "max"}
SET_CALLS = {"set", "frozenset"}
SET_METHODS = {"union", "intersection", "difference", "symmetric_difference", "copy"}
SET_OPERATORS = (ast.BitOr, ast.BitAnd, ast.Sub, ast.BitXor)


def _is_set_annotation(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    text = ast.unparse(annotation).strip("'\"")
    return text.split("[")[0].split(".")[-1] in {"set", "frozenset", "Set", "FrozenSet", "AbstractSet", "MutableSet"}


class _Scope:
    """What a module, class or function binds to sets: names, ``self`` attributes, functions returning one."""

    def __init__(self, names: set[str], attributes: set[str], functions: set[str]) -> None:
        self.names, self.attributes, self.functions = names, attributes, functions

    def is_set(self, node: ast.expr) -> bool:
        if isinstance(node, (ast.Set, ast.SetComp)):
            return True
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                return func.id in SET_CALLS or func.id in self.functions
            if isinstance(func, ast.Attribute):
                return func.attr in self.functions or (func.attr in SET_METHODS and self.is_set(func.value))
        if isinstance(node, ast.BinOp) and isinstance(node.op, SET_OPERATORS):
            return any(self.is_set(side) or _is_key_view(side) for side in (node.left, node.right))
        if isinstance(node, ast.Name):
            return node.id in self.names
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr in self.attributes
        return False


def _is_key_view(node: ast.expr) -> bool:
    """``d.keys()``/``d.items()``: a set operation on one gives a set."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in {"keys", "items"}


def _own_nodes(scope: ast.AST):
    """The nodes of ``scope``'s own body, not those of functions or classes defined inside it."""
    pending = list(ast.iter_child_nodes(scope))
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))


def _set_names(scope: ast.AST, outer: _Scope) -> set[str]:
    """Names that every binding in ``scope`` binds to a set (a parameter annotated as one counts)."""
    probe = _Scope(set(), outer.attributes, outer.functions)
    bound: dict[str, list[bool]] = {}
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        arguments = scope.args
        for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
            bound.setdefault(arg.arg, []).append(_is_set_annotation(arg.annotation))
    for node in _own_nodes(scope):
        if isinstance(node, (ast.Assign, ast.NamedExpr)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    bound.setdefault(target.id, []).append(probe.is_set(node.value))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            bound.setdefault(node.target.id, []).append(
                _is_set_annotation(node.annotation) or (node.value is not None and probe.is_set(node.value)))
        for target in _other_bindings(node):  # a loop's or a ``with``'s names: not sets as far as this check knows
            bound.setdefault(target, []).append(False)
    inherited = {n for n in outer.names if n not in bound}
    return inherited | {name for name, sets in bound.items() if all(sets)}


def _other_bindings(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        targets = [node.target]
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        targets = [item.optional_vars for item in node.items if item.optional_vars is not None]
    else:
        return []
    return [name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)]


def _set_attributes(cls: ast.ClassDef, outer: _Scope) -> set[str]:
    """``self`` attributes that every assignment in ``cls`` binds to a set."""
    probe = _Scope(set(), set(), outer.functions)
    bound: dict[str, list[bool]] = {}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                is_set = probe.is_set(node.value) if node.value is not None else False
                bound.setdefault(target.attr, []).append(
                    is_set or (isinstance(node, ast.AnnAssign) and _is_set_annotation(node.annotation)))
    return {name for name, sets in bound.items() if all(sets)}


def _iterated(node: ast.AST, order_free: set[int]) -> list[ast.expr]:
    """What ``node`` iterates over in order; ``order_free``: the ids of the nodes whose order nothing keeps."""
    if isinstance(node, (ast.For, ast.AsyncFor)):
        return [node.iter]
    if isinstance(node, (ast.ListComp, ast.DictComp, ast.GeneratorExp)) and id(node) not in order_free:
        return [generator.iter for generator in node.generators]
    if isinstance(node, ast.Starred):
        return [node.value]
    if isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if name in ORDER_KEEPING:
            return list(node.args)
    return []


def unordered_iterations(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: code`` for each place in ``source`` that iterates over a set in the set's own order."""
    tree = ast.parse(source, filename)
    functions = {node.name for node in ast.walk(tree)
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_set_annotation(node.returns)}
    # What ``sorted``, a set or a count is made of keeps no order: ``sorted(k for k in set(a) & set(b))`` is ordered.
    order_free = {id(arg) for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ORDER_FREE for arg in node.args}
    found: list[str] = []

    def visit(scope: ast.AST, outer: _Scope) -> None:
        attributes = _set_attributes(scope, outer) if isinstance(scope, ast.ClassDef) else outer.attributes
        here = _Scope(_set_names(scope, _Scope(outer.names, attributes, functions)), attributes, functions)
        if isinstance(scope, ast.ClassDef):
            here.names = outer.names  # a class body's names are not visible in its methods
        for node in _own_nodes(scope):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                visit(node, here)
                continue
            for iterable in _iterated(node, order_free):
                if here.is_set(iterable):
                    found.append(f"{filename}:{node.lineno}: {ast.unparse(node).splitlines()[0][:100]}")

    visit(tree, _Scope(set(), set(), functions))
    return sorted(set(found), key=lambda line: int(line.split(":")[1]))


def test_no_library_loop_follows_a_sets_order() -> None:
    modules = sorted(LIBRARY.rglob("*.py"))
    assert len(modules) > 50  # the whole package, not an empty glob
    found = [line for path in modules for line in unordered_iterations(path.read_text(), str(path))]
    assert found == [], "iterations in a set's order (address or hash-seed order, which differs between ranks):\n" + \
        "\n".join(found)


# The loops commit d127bf2 fixed (runtime.py's ``release``, user_view.py's ``gathered_gradients``): each
# issued one all-gather per dtype in a set's order, and the check must see them.
RELEASE_BEFORE_D127BF2 = """
def release(self, replaced):
    for dtype in {s.local.dtype for s in replaced}:
        for bucket in make_buckets([s for s in replaced if s.local.dtype == dtype], bucket_bytes, dtype):
            gather_bucket(self.comms, transient, bucket, [s.local for s in bucket.shards])
"""
GATHERED_GRADIENTS_BEFORE_D127BF2 = """
def gathered_gradients(self, with_grads, shown):
    for dtype in {shown[s].dtype for s in with_grads}:
        group = [s for s in with_grads if shown[s].dtype == dtype]
"""


@pytest.mark.parametrize("source", [RELEASE_BEFORE_D127BF2, GATHERED_GRADIENTS_BEFORE_D127BF2])
def test_sees_the_loops_that_issued_gathers_in_address_order(source: str) -> None:
    assert len(unordered_iterations(source)) == 1
    fixed = source.replace("{s.local.dtype for s in replaced}", "dict.fromkeys(s.local.dtype for s in replaced)")
    fixed = fixed.replace("{shown[s].dtype for s in with_grads}", "dict.fromkeys(shown[s].dtype for s in with_grads)")
    assert unordered_iterations(fixed) == []


SEEN = {
    "set display": "for x in {a, b}: pass",
    "set comprehension": "ys = [f(x) for x in {p.dtype for p in ps}]",
    "set() call": "for x in set(names): pass",
    "frozenset() call": "for x in frozenset(names): pass",
    "set operation": "for x in set(a) - set(b): pass",
    "key views' operation": "for k in d.keys() & e.keys(): pass",
    "a name bound to a set": "def f(ps):\n    dtypes = {p.dtype for p in ps}\n    for d in dtypes: pass",
    "a parameter annotated as a set": "def f(ps: set[int]):\n    return [p for p in ps]",
    "a self attribute bound to a set": ("class C:\n    def __init__(self):\n        self.done: set[int] = set()\n"
                                        "    def f(self):\n        for u in self.done: pass"),
    "a function returning a set": ("def g() -> set[str]:\n    return {'a'}\n"
                                   "def f():\n    for name in g(): pass"),
    "list()": "order = list({a, b})",
    "enumerate()": "for i, x in enumerate({a, b}): pass",
    "a generator joined": "text = ', '.join(k for k in set(a) & set(b))",
    "dict.fromkeys()": "order = dict.fromkeys({a, b})",
    "unpacking": "order = [*{a, b}]",
    "a closure": "def f(ps):\n    dtypes = set(ps)\n    def g():\n        return [d for d in dtypes]",
}
NOT_SEEN = {
    "sorted()": "for x in sorted({a, b}): pass",
    "a generator sorted": "names = sorted(k for k in set(a) & set(b) if k)",
    "a set made from a set": "kinds = {type(x) for x in {a, b}}",
    "model order": "for d in dict.fromkeys(p.dtype for p in ps): pass",
    "membership": "def f(ps):\n    keep = set(ps)\n    return [p for p in qs if p in keep]",
    "order-free reductions": "n = len({a, b}) + sum(1 for _ in range(3)) + max({1, 2})",
    "a name rebound to a list": "def f(ps):\n    ds = set(ps)\n    ds = sorted(ds, key=str)\n    for d in ds: pass",
    "the same name as a list elsewhere": ("def f(ps):\n    owned = set(ps)\n"
                                          "def g(ps):\n    owned = list(ps)\n    for s in owned: pass"),
}


@pytest.mark.parametrize("source", SEEN.values(), ids=SEEN.keys())
def test_sees_an_iteration_over_a_set(source: str) -> None:
    assert len(unordered_iterations(textwrap.dedent(source))) == 1, source


@pytest.mark.parametrize("source", NOT_SEEN.values(), ids=NOT_SEEN.keys())
def test_passes_an_order_the_code_chose(source: str) -> None:
    assert unordered_iterations(textwrap.dedent(source)) == [], source
