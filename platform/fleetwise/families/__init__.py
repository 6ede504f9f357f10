"""Model families: one module per family, one `Family` record each (see `base.Family`).

Adding a family is one module here (schema, rules, planner units, rank-side builder and data
source) plus its `conf/model/<name>.yaml` and recipes; the config union, the rules, the planner and
the runtime reach it through `FAMILIES` / `family_of`. Importing this package never imports torch.
"""

from __future__ import annotations

import sys

from fleetwise.families import ctr, ernie, gpt, resnet
from fleetwise.families.base import Family, ModelSpec
from fleetwise.plan.units import Unit

# Order matters to users: it is the order of the `model.family` tags in error messages.
FAMILIES: dict[str, Family] = {f.name: f for f in (gpt.FAMILY, ernie.FAMILY, resnet.FAMILY, ctr.FAMILY)}


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
