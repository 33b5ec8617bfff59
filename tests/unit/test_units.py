"""The stage-3 unit plan: explicit classes and paths, the automatic policy, tied weights in the root unit."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_zero.sharding.units import plan_units
from tests.models import AdapterModel, TinyLM


def _plan(module, units=(), unit_bytes=1 << 30):
    root, plans = plan_units(module, units, unit_bytes)
    names = {id(p): n for n, p in module.named_parameters()}
    return [names[id(p)] for p in root.params], {plan.name: [names[id(p)] for p in plan.params] for plan in plans}


def _lm() -> TinyLM:
    model = TinyLM()
    model.configure_model()
    return model


def test_transformer_layers_are_units_by_default_and_tied_weights_stay_in_the_root() -> None:
    root, units = _plan(_lm())
    assert list(units) == ["lm.blocks.0", "lm.blocks.1"]
    assert "lm.wte.weight" in root  # tied to lm.head.weight: used by two modules in two places
    assert len(units["lm.blocks.0"]) == 11


def test_units_by_class_name_and_by_module_path() -> None:
    _, units = _plan(_lm(), units=("LayerNorm",))
    assert list(units) == ["lm.blocks.0.ln1", "lm.blocks.0.ln2", "lm.blocks.1.ln1", "lm.blocks.1.ln2", "lm.ln_f"]
    _, units = _plan(AdapterModel(), units=("adapt?", "tests.models.LoRALinear"))
    assert list(units) == ["adapt1", "adapt2"]
    assert units["adapt1"] == ["adapt1.base.weight", "adapt1.base.bias", "adapt1.lora_a", "adapt1.lora_b"]


def test_size_policy_makes_the_smallest_subtrees_that_reach_the_threshold() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), nn.Linear(64, 2))
    root, units = _plan(model, unit_bytes=64 * 64 * 4)
    assert units == {"0.0": ["0.0.weight", "0.0.bias"], "0.1": ["0.1.weight", "0.1.bias"]}
    assert root == ["1.weight", "1.bias"]
    every = sorted(root + [p for ps in units.values() for p in ps])
    assert every == sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("units,unmatched", [
    (("Blok",), ["Blok"]),
    (("Block", "Blok"), ["Blok"]),  # beside an entry that matches: it was only warned about, then ignored
    (("LayerNorm", "lm.blocks.9", "tests.models.Block"), ["lm.blocks.9"]),
])
def test_every_units_entry_that_matches_no_module_is_refused_naming_it_and_the_classes(units, unmatched) -> None:
    with pytest.raises(ValueError) as raised:
        _plan(_lm(), units=units)
    assert str(raised.value) == (
        f"units={list(units)}: {unmatched} match no module of TinyLM (module classes with parameters here: Block, "
        "Embedding, LayerNorm, Linear, ModuleDict, ModuleList, Sequential); give class names, qualified class names "
        "or module paths"
    )
