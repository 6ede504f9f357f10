"""Click-through-rate model over sparse id fields and dense features: DeepFM or Wide&Deep.
The family the parameter server trains: its embedding tables can live on servers.

The family in one package: `schema` (the `model` section and its rules), `units` (the planner's
view and every parameter's shape), `model` (the nn.Module, its table initialisation), `data`
(synthetic click logs). It has no tensor-parallel plan and is not pipelined. The rank-side parts
are imported when a rank asks for them (`spec`, `source`; `fleetwise.runtime.ps` imports them
itself), so importing this package never imports torch.
"""

from __future__ import annotations

import math

from fleetwise.families.ctr.schema import CTRModel, check, limits
from fleetwise.families.ctr.units import input_bytes, parameter_shapes, units
from fleetwise.families.record import Family, ModelSpec


def data_profile(m: CTRModel, d) -> dict:
    return {"zipf_alpha": d.zipf_alpha, "model": m.model_dump(mode="json")}


def spec(_: CTRModel) -> ModelSpec:
    from fleetwise.families.ctr.model import CTRNet, ctr_loss

    return ModelSpec(CTRNet, ctr_loss, ("sparse_ids", "dense"))


def source(m: CTRModel, d):
    from fleetwise.families.ctr.data import SyntheticClicks

    return SyntheticClicks(m, d)


FAMILY = Family(
    name="ctr",
    schema=CTRModel,
    units=units,
    input_bytes=input_bytes,
    spec=spec,
    source=source,
    check=check,
    limits=limits,
    data_profile=data_profile,
    no_tensor_parallel=(
        "its embedding tables belong on parameter servers",
        "set strategy.mp_degree=1 and use dp or sharding, or strategy=ps",
    ),
    no_pipeline=(
        "a CTR model: its MLP is too shallow to pipeline",
        "set strategy.pp_degree=1; use strategy=ps for large embedding tables",
    ),
    no_recompute=("a CTR model has no repeated blocks to recompute", "set strategy.recompute=none"),
    sparse_tables=lambda m: m.sparse_tables,
    sparse_row_width=lambda m: m.embedding_dim + 1,  # embedding + first-order weight
    parameter_shapes=parameter_shapes,
    chance_loss=lambda m: math.log(2),
)
