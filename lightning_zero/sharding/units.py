"""Which parameters are gathered together in stage 3: the unit plan. Bookkeeping only, no communication.

[Note: how the model is split into units]
A unit is a submodule whose parameters are all-gathered together right before it runs and freed right after. The
plan walks the module tree bottom-up (post-order) and makes a unit of a submodule when

- ``units`` is given and the submodule's class name (``Block``), qualified class name (``my_pkg.model.Block``) or
  module path (``model.layers.3``, shell-style wildcards allowed: ``model.layers.*``) matches one of its entries; or
- ``units`` is empty and the submodule is an element of an ``nn.ModuleList`` (the usual stack of transformer
  layers), or the parameters of its subtree not already in a smaller unit reach ``unit_bytes``.

Whatever is left, and every parameter used by more than one module (tied weights such as a language model's input
embedding and output projection), belongs to the root unit, which is gathered for the whole training step: a tied
weight must be present for both of its uses, which may sit in different units.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from torch import nn


#: Module classes an error about ``units`` names at most.
SHOWN_CLASSES = 16


@dataclass(eq=False)
class UnitPlan:
    """One unit: the module whose forward brackets the gather, and the parameters it owns (in module order)."""

    name: str
    module: nn.Module
    params: list[nn.Parameter] = field(default_factory=list)


def plan_units(root: nn.Module, units: tuple[str, ...], unit_bytes: int) -> tuple[UnitPlan, list[UnitPlan]]:
    """Split ``root``'s parameters into a root unit and submodule units (see [Note: how the model is split into units]).

    Returns ``(root_unit, units)``, ``units`` in pre-order of the module tree, each parameter in exactly one of them.
    """
    shared = _shared_parameters(root)
    assigned: set[nn.Parameter] = set(shared)
    plans: list[UnitPlan] = []
    visited: set[nn.Module] = set()
    matched: set[str] = set()

    def visit(module: nn.Module, name: str, listed: bool) -> list[nn.Parameter]:
        visited.add(module)
        pending: list[nn.Parameter] = []
        for child_name, child in module.named_children():
            if child not in visited:
                path = f"{name}.{child_name}" if name else child_name
                pending += visit(child, path, isinstance(module, nn.ModuleList))
        pending += [p for p in module.parameters(recurse=False) if p not in assigned]
        pending = list(dict.fromkeys(pending))
        if module is root or not pending:
            return pending
        if _matches(module, name, units, matched) if units else (listed or _nbytes(pending) >= unit_bytes):
            plans.append(UnitPlan(name, module, pending))
            assigned.update(pending)
            return []
        return pending

    leftover = visit(root, "", False)
    _check_all_matched(root, units, matched)
    order = {m: i for i, m in enumerate(root.modules())}
    plans.sort(key=lambda plan: order[plan.module])
    root_params = list(dict.fromkeys(leftover + [p for p in root.parameters() if p in shared]))
    return UnitPlan("", root, root_params), plans


def _shared_parameters(root: nn.Module) -> set[nn.Parameter]:
    """Parameters registered on more than one module (tied weights)."""
    owners: dict[nn.Parameter, int] = {}
    for module in root.modules():
        for param in module.parameters(recurse=False):
            owners[param] = owners.get(param, 0) + 1
    return {p for p, count in owners.items() if count > 1}


def _matches(module: nn.Module, name: str, patterns: tuple[str, ...], matched: set[str]) -> bool:
    cls = type(module)
    candidates = (cls.__name__, f"{cls.__module__}.{cls.__qualname__}", name)
    hits = {p for p in patterns for c in candidates if fnmatch.fnmatchcase(c, p)}
    matched |= hits
    return bool(hits)


def _check_all_matched(root: nn.Module, units: tuple[str, ...], matched: set[str]) -> None:
    """An entry of ``units`` that names no module is a typo to refuse, each one: alone it would make the whole model
    one unit, gathered at once; beside entries that match, the modules it meant would silently join their parent's
    unit."""
    for name, module in root.named_modules():  # entries matching only modules without own parameters
        if name:
            _matches(module, name, units, matched)
    unmatched = [u for u in units if u not in matched]
    if not unmatched:
        return
    classes = sorted({type(m).__name__ for m in root.modules() if m is not root and any(True for _ in m.parameters())})
    more = f" and {len(classes) - SHOWN_CLASSES} more" if len(classes) > SHOWN_CLASSES else ""
    raise ValueError(
        f"units={list(units)}: {unmatched} match no module of {type(root).__name__} (module classes with parameters "
        f"here: {', '.join(classes[:SHOWN_CLASSES])}{more}); give class names, qualified class names or module paths"
    )


def _nbytes(params: list[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)
