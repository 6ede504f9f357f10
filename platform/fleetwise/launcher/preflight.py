"""Everything `validate`, `plan` and `train` check before a process starts: compose, validate,
plan, and the memory fit (with remedies)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fleetwise.config.problems import ConfigError, Problem
from fleetwise.config.run import RunConfig
from fleetwise.plan.records import Plan
from fleetwise.plan.remedies import Remedy

if TYPE_CHECKING:
    from fleetwise.launcher.auto import AutoOutcome


@dataclass
class Preflight:
    """A composed, validated, resolved config and its plan; or the problems found on the way."""

    cfg: RunConfig | None = None
    plan: Plan | None = None
    problems: list[Problem] = field(default_factory=list)
    remedies: list[Remedy] = field(default_factory=list)
    auto: AutoOutcome | None = None  # strategy=auto: the search that chose the layout


def preflight(overrides: list[str], *, launching: bool = False, enforce_memory: bool = True) -> Preflight:
    from fleetwise.launcher import auto

    if auto.requested(overrides):  # search, then check the winner like a typed-in layout
        outcome = auto.resolve_auto(overrides)
        if outcome.problems:
            return Preflight(problems=outcome.problems, auto=outcome)
        pf = _preflight(outcome.command, launching=launching, enforce_memory=enforce_memory)
        pf.auto = outcome
        return pf
    return _preflight(overrides, launching=launching, enforce_memory=enforce_memory)


def _preflight(overrides: list[str], *, launching: bool, enforce_memory: bool) -> Preflight:
    from fleetwise.config.recipes import mark_recipe_values
    from fleetwise.config.validate import load_config
    from fleetwise.plan import make_plan
    from fleetwise.plan.remedies import remedies

    problems: list[Problem] = []
    try:
        cfg = load_config(overrides, launching=launching)
    except ConfigError as err:
        found = mark_recipe_values(err.problems, overrides)
        if not launching:
            return Preflight(problems=found + _memory_as_given(overrides, err.problems, enforce_memory))
        try:  # only rules about starting processes failed? Then plan it too and list everything
            cfg = load_config(overrides)
        except ConfigError as plain:
            return Preflight(problems=found + _memory_as_given(overrides, plain.problems, enforce_memory))
        problems += found
    plan = make_plan(cfg)
    fixes = [] if plan.fits else remedies(cfg)
    if not plan.fits and enforce_memory and cfg.plan.memory_check == "error":
        problems.append(memory_problem(plan, fixes))
    return Preflight(cfg=cfg, plan=plan, problems=problems, remedies=fixes)


# Where a problem makes the layout or the sizes unknown, so that the config cannot be planned as
# given. Any other problem (a precision the hardware lacks, a data file, tracking, launch, …) leaves
# the memory plan meaningful, and its verdict is listed beside it.
STRUCTURAL = (
    "<overrides>",
    "strategy",
    "model",
    "recipe",
    "hardware.nodes",
    "hardware.devices_per_node",
    "hardware.memory_per_device_gib",
    "train.global_batch_size",
    "train.micro_batch_size",
    "train.accumulate_steps",
)


def _memory_as_given(overrides: list[str], problems: list[Problem], enforce: bool) -> list[Problem]:
    """The memory verdict of a config whose only problems leave it plannable ("every problem at
    once": the memory problem is not held back until the others are fixed)."""
    from fleetwise.config.compose import compose_partial
    from fleetwise.config.validate import parse, resolve
    from fleetwise.plan import make_plan
    from fleetwise.plan.remedies import remedies

    if not enforce or not problems or any(p.loc.startswith(STRUCTURAL) for p in problems):
        return []
    data, hydra_problems = compose_partial(overrides)
    cfg, _ = parse(data) if data and not hydra_problems else (None, [])
    if cfg is None or cfg.plan.memory_check != "error":
        return []
    try:
        cfg = resolve(cfg)
        plan = make_plan(cfg)
    except Exception:  # noqa: BLE001 - not plannable as given after all: the other problems say why
        return []
    if plan.fits:
        return []
    problem = memory_problem(plan, remedies(cfg, tolerate={p.loc for p in problems}))
    others = ", ".join(dict.fromkeys(p.loc for p in problems))
    return [Problem(problem.loc, f"{problem.msg} (planned as given, {others} unchanged)", problem.hint)]


def memory_problem(plan: Plan, fixes: list[Remedy]) -> Problem:
    from fleetwise.plan.render import gib, memory_parts

    m = plan.memory_bytes
    cures = "; ".join(r.describe() for r in fixes) or "a larger device, or fewer layers per device"
    return Problem(
        "hardware.memory_per_device_gib",
        f"the worst device needs {gib(m['total'])} ({memory_parts(plan)}) but has "
        f"{gib(plan.device_memory_bytes)}"
        + (
            f" of which {gib(plan.usable_memory_bytes)} are usable (hardware.device_overhead_gib, "
            "hardware.fragmentation)"
            if plan.device_overhead_bytes
            else ""
        ),
        f"cheapest remedies: {cures}; or plan.memory_check=warn to launch anyway",
    )
