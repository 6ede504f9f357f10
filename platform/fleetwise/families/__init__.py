"""Model families: one module per family, one `Family` record each (see `base.Family`).

Adding a family is one module here (schema, rules, planner units, rank-side builder and data
source) plus its `conf/model/<name>.yaml` and recipes; the config union, the rules, the planner and
the runtime reach it through `FAMILIES` / `family_of`. Importing this package never imports torch.
"""

from __future__ import annotations

from fleetwise.families import ctr, ernie, gpt, resnet
from fleetwise.families.base import Family, ModelSpec
from fleetwise.plan.units import Unit

# Order matters to users: it is the order of the `model.family` tags in error messages.
FAMILIES: dict[str, Family] = {f.name: f for f in (gpt.FAMILY, ernie.FAMILY, resnet.FAMILY, ctr.FAMILY)}


def family_of(model) -> Family:
    """The registry entry of a validated `model` section."""
    return FAMILIES[model.family]


def model_units(model) -> list[Unit]:
    return family_of(model).units(model)


def total_params(model) -> int:
    return sum(u.params for u in model_units(model))


__all__ = ["FAMILIES", "Family", "ModelSpec", "family_of", "model_units", "total_params"]
