"""Analytic planner: memory, FLOPs, communication, pipeline bubble, step time. Never imports torch."""

from fleetwise.plan.planner import Plan, make_plan

__all__ = ["Plan", "make_plan"]
