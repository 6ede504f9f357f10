"""Model families: one package per family, one `Family` record each (`record.Family`).

    families/<name>/__init__.py   FAMILY: the record that ties the parts together
                    schema.py     the `model` section (pydantic) and its rules
                    units.py      the model as a chain of planner units
                    model.py      the nn.Module (obeys fleetwise.models.contract)
                    tp_plan.py    its tensor-parallel plan (families that have one)
                    data.py       its sample source (families with a data source of their own)
    families/custom/              your own nn.Module and Dataset (`model=custom`): units measured, not written
    families/transformer.py       what GPT and ERNIE share (schema fields, block unit, checks, tokens;
                                  Llama: the tokens and the mp check)
    families/record.py            `Family` and `ModelSpec`

Adding a family is one package here plus its `conf/model/<name>.yaml` and recipes (a family from
outside, a plugin or a test, calls `register`); the config union, the rules, the planner and the
runtime reach it through `FAMILIES` / `family_of`. Importing this package never imports torch: the
records name their rank-side parts (`model`, `tp_plan`, `data`) in functions a rank calls.

How config's `model` union reaches the families, and why that is no import cycle:
`fleetwise.config.model` imports this registry and builds the `model` union (one schema per
family, told apart by `family`) from `FAMILIES` when it is imported. The families, in turn, import
from config only its two leaves -- `config.base` (`Section`) and `config.problems` (`Problem`),
which import nothing of fleetwise -- and never `config.model` or `config.run`. Where a family's
code reads another config section (a data source reads the `data` section), it takes it as a
protocol of the fields it reads (`families/ctr/data.py: ClickData`) or untyped, so the import graph
runs config.model -> families -> config.base, and never back.
"""

from __future__ import annotations

import sys

from fleetwise.families import ctr, custom, ernie, gpt, llama, resnet
from fleetwise.families.record import Family, ModelSpec
from fleetwise.plan.units import Unit

# Order matters to users: it is the order of the `model.family` tags in error messages.
FAMILIES: dict[str, Family] = {
    f.name: f for f in (gpt.FAMILY, ernie.FAMILY, resnet.FAMILY, ctr.FAMILY, llama.FAMILY, custom.FAMILY)
}


def register(family: Family) -> Family:
    """Add a family defined outside this package (a plugin, a test). The `model` config union is
    built once, when `fleetwise.config.model` is imported, so registering must come first."""
    if "fleetwise.config.model" in sys.modules:
        raise RuntimeError(f"register({family.name!r}) after fleetwise.config.model was imported")
    if family.name in FAMILIES or family.schema.model_fields["family"].default != family.name:
        raise ValueError(f"family {family.name!r}: taken, or its schema's `family` default differs")
    FAMILIES[family.name] = family
    return family


def family_of(model) -> Family:
    """The registry entry of a validated `model` section."""
    return FAMILIES[model.family]


def model_units(model) -> list[Unit]:
    return family_of(model).units(model)


def total_params(model) -> int:
    return sum(u.params for u in model_units(model))


__all__ = ["FAMILIES", "Family", "ModelSpec", "family_of", "model_units", "register", "total_params"]
