"""Analytic planner: memory, FLOPs, communication, pipeline bubble, step time. Never imports torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetwise.plan.planner import Plan, make_plan

__all__ = ["Plan", "make_plan"]


def __getattr__(name: str):
    # Lazy (PEP 562): the model families build their units from `plan.units` while the planner
    # imports the config, which imports the families; importing this package must not pull in the planner.
    if name in __all__:
        from fleetwise.plan import planner

        return getattr(planner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
