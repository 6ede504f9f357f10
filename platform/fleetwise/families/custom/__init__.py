"""Your own model (`model=custom`): any nn.Module and Dataset through Hydra `_target_`.

The family in one package: `schema` (the `model` section and its rules), `targets` (the
`_target_`s imported and checked, not called), `derive` (the module traced on fake tensors: its
problems and planner units, cached), `model` (the module adapted to the model contract in place,
and its initialisation replayed shard by shard), `data` (the Dataset as a sample source). Where a
built-in family writes its planner units by hand, this one measures them; what the module allows
(tensor parallelism with `tp_plan`, a pipeline when forward is a chain) is found by the trace, and
what it does not allow is refused by `validate` with why. Importing this package never imports
torch; checking a config with `model=custom` does (it imports your module, which imports torch).
"""

from __future__ import annotations

from typing import Any

from fleetwise.families.custom.schema import CustomModel, check, tensor_parallel
from fleetwise.families.record import Family, ModelSpec
from fleetwise.plan.units import Unit


def _derived(m: CustomModel):
    from fleetwise.families.custom.derive import derived

    return derived(m)


def units(m: CustomModel) -> list[Unit]:
    return _derived(m).units


def input_bytes(m: CustomModel) -> int:
    return _derived(m).sample_bytes


def spec(m: CustomModel) -> ModelSpec:
    from fleetwise.families.custom.model import build, make_loss

    d = _derived(m)
    inputs = tuple(m.inputs) if m.inputs else tuple(k for k in d.batch_keys if m.loss is None or k != m.label)
    tp = None
    if m.tp_plan:
        from fleetwise.families.custom.tp_plan import tp_plan

        tp = lambda sequence_parallel: tp_plan(m.tp_plan)  # noqa: E731
    return ModelSpec(
        build=lambda _m: build(m),
        loss=make_loss(m),
        inputs=inputs,
        tp_plan=tp,
        label=m.label or inputs[0],  # forward returns the loss: the label is not read
    )


def source(m: CustomModel, d: Any):
    from fleetwise.families.custom.data import source

    return source(m, d)


def no_pipeline(m: CustomModel) -> tuple[str, str] | None:
    d = _derived(m)
    if d.chain is not None or d.unchecked:  # unchecked: not imported, so nothing to say about it
        return None
    if d.problems:
        return ("your model, which could not be checked (its problems are listed)", "fix those first")
    return (
        f"your model: {d.no_chain}",
        "set model.blocks (an nn.ModuleList child of the root), model.inputs, model.label and model.loss, "
        "with forward running the modules before the blocks, the blocks and the modules after them one "
        "into the next; or use strategy.pp_degree=1",
    )


def no_recompute(m: CustomModel) -> tuple[str, str] | None:
    if m.blocks:
        return None
    return ("your model has no model.blocks to recompute", "set model.blocks, or strategy.recompute=none")


def plan_notes(m: CustomModel) -> list[str]:
    d = _derived(m)
    if d.problems:
        return []
    return ["your model (model=custom), measured: " + "; ".join(d.measured)]


def data_profile(m: CustomModel, d: Any) -> dict:
    return {"dataset": d.dataset}


FAMILY = Family(
    name="custom",
    schema=CustomModel,
    units=units,
    input_bytes=input_bytes,
    spec=spec,
    source=source,
    check=check,
    data_sources=("custom",),
    data_profile=data_profile,
    plan_notes=plan_notes,
    tensor_parallel=tensor_parallel,
    no_pipeline=no_pipeline,
    no_recompute=no_recompute,
    chain_traced=True,
    no_parameter_server=(
        "the parameter server trains the CTR family's sparse tables; your own model is out of its scope",
        "use a collective strategy: dp, sharding, mp, pp or hybrid",
    ),
)
