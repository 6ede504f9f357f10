"""Analytic planner: memory, FLOPs, communication, pipeline bubble, step time. Never imports torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetwise.plan.planner import make_plan
    from fleetwise.plan.records import Plan

__all__ = ["Plan", "make_plan"]


def __getattr__(name: str):
    # Lazy (PEP 562): the model families build their units from `plan.units` while the planner
    # imports the config, which imports the families; importing this package must not pull in the planner.
    if name == "Plan":
        from fleetwise.plan.records import Plan

        return Plan
    if name == "make_plan":
        from fleetwise.plan.planner import make_plan

        return make_plan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
