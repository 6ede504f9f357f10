"""Analytic planner: memory, FLOPs, communication, pipeline bubble, step time. Never imports torch.

Where each part lives:
    planner.py   make_plan, the front door: a validated config in, a `Plan` out
    records.py   Plan and Memory, the records the planner fills; step_parts
    job.py       what a collective plan starts from (layout, engine, micro-batches, chunks)
    chunks.py    the model's units on the pipeline: chunks, ranks, roles, equal-unit groups
    memory/      one device's peak: model states, activations, pipeline buffers, phases; per rank
    time.py      FLOPs, each stage's compute and host work, overlap, offload: the step time
    comm.py      bytes and calls per mesh dimension, and their time
    dtypes.py    bytes per element by precision and engine
    pipeline.py  the schedules: chunk placement, micro-batches in flight, bubble
    ps.py        the parameter server: where its variables live, and its plan
    units.py     a model as a chain of units (what the families build)
    cache.py     the one cache a layout search relies on (PLAN_CACHE, one clear())
    search.py    strategy=auto;  remedies.py: what makes a plan fit;  render.py: the terminal view
"""

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
