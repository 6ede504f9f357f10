"""Your own model's `model` section (`model=custom`) and its rules.

The section names the module and what fleetwise needs to know about it; everything else (its
parameters, blocks, activations, FLOPs) is measured by tracing it (families/custom/derive.py) and
is checked here: every problem of the module, its loss, its dataset and its tensor-parallel plan
is reported by `validate` with its config path, at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, PrivateAttr

from fleetwise.config.base import Section
from fleetwise.config.problems import Problem


class CustomModel(Section):
    """Any nn.Module, built by Hydra from `module` (`_target_` and keyword arguments)."""

    family: Literal["custom"] = "custom"
    module: dict[str, Any] | None = Field(
        None,
        description="Your nn.Module as hydra.utils.instantiate builds it: `_target_` (a class or a "
        "function returning a module) and its keyword arguments; built on the meta device.",
    )
    blocks: str | None = Field(
        None,
        description="Dotted path to the nn.ModuleList of repeated blocks: FSDP shards each as a unit, "
        "recompute and compile wrap each, a pipeline splits between them (null: no blocks).",
    )
    inputs: list[str] | None = Field(
        None, description="Batch keys passed to forward positionally, in order (null: forward(**batch))."
    )
    label: str | None = Field(None, description="Batch key of the target passed to `loss`.")
    loss: dict[str, Any] | None = Field(
        None,
        description="(output, label) -> scalar, e.g. {_target_: torch.nn.functional.cross_entropy, "
        "_partial_: true}; null: forward returns the loss (a tensor, or an object/dict with `loss`).",
    )
    tp_plan: dict[str, Literal["colwise", "rowwise", "sequence"]] = Field(
        default_factory=dict,
        description="Tensor parallelism: module-name patterns (`*` for one name part) -> colwise | "
        "rowwise | sequence; each must match a module, and the split dims divide by mp_degree.",
    )
    _dataset: dict[str, Any] | None = PrivateAttr(None)

    def bind_data(self, data: Any) -> None:
        """The dataset the units are traced on (config/run.py calls this)."""
        self._dataset = data.dataset if data.source == "custom" else None

    @property
    def dataset(self) -> dict[str, Any] | None:
        return self._dataset

    @property
    def num_layers(self) -> int | None:
        """Blocks: the units a pipeline split distributes (measured on the built module); None when
        the module was held back unimported (`validate` of a recipe from elsewhere)."""
        from fleetwise.families.custom.derive import derived

        d = derived(self)
        return None if d.unchecked else d.num_blocks


def check(m: CustomModel) -> Iterator[Problem]:
    """Every problem of the module, its loss, dataset, blocks and tensor-parallel plan."""
    from fleetwise.families.custom.derive import derived

    yield from derived(m).problems


def tensor_parallel(m: CustomModel, mp: int) -> Iterator[Problem]:
    """A tensor-parallel plan is needed, and every dim it splits divides by mp."""
    from fleetwise.families.custom.derive import derived

    if not m.tp_plan:
        yield Problem(
            "strategy.mp_degree",
            f"mp_degree={mp} but model.tp_plan is empty: fleetwise does not know which layers to split",
            "give model.tp_plan (e.g. 'trunk.*.fc1': colwise, 'trunk.*.fc2': rowwise), or use "
            "strategy.mp_degree=1 with dp or sharding",
        )
        return
    d = derived(m)
    bad: dict[tuple[str, int], list[str]] = {}
    for path, (style, size) in d.tp_dims.items():
        if size % mp:
            bad.setdefault((style, size), []).append(path)
    for (style, size), paths in bad.items():
        dim = {"colwise": "output features", "rowwise": "input features"}.get(style, "features")
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        yield Problem(
            "strategy.mp_degree",
            f"{shown} ({style}) {'have' if len(paths) > 1 else 'has'} {size} {dim}, which do not divide "
            f"by mp_degree={mp}",
            f"use an mp_degree that divides {size}, or change the module's size",
        )
