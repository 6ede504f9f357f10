"""The planner's shape: typed engine and schedule values, one cache, public names across its
border (issue 37; its functions' length is held with the whole package's, architecture/)."""

from __future__ import annotations

import ast

from helpers.config import compose
from helpers.repo import REPO

from fleetwise.config.engine import Engine, dp_engine
from fleetwise.config.layout import Layout
from fleetwise.config.strategy import Schedule
from fleetwise.plan import make_plan
from fleetwise.plan.cache import PLAN_CACHE
from fleetwise.plan.pipeline import PipelineSchedule

PACKAGE = REPO / "platform" / "fleetwise"


def test_pipeline_schedule_names_every_schedule_the_config_accepts():
    assert [s.value for s in PipelineSchedule] == list(Schedule.__args__)
    assert {s for s in PipelineSchedule if s.zero_bubble} == {"interleaved_zero_bubble", "ZBV_zero_bubble"}
    assert {s for s in PipelineSchedule if not s.multi_stage} == {"GPipe", "1F1B"}


def test_engine_is_its_name_as_a_string():
    """A StrEnum: plans, JSON and logs carry the same text as before it was typed."""
    import json

    engine = dp_engine(Layout(sharding=2), 2)
    assert engine is Engine.FSDP and engine == "fsdp" and f"{engine}" == "fsdp"
    assert json.dumps({"engine": engine}) == '{"engine": "fsdp"}'
    assert [dp_engine(Layout(dp=2), None), dp_engine(Layout(sharding=2), 1), dp_engine(Layout(), None)] == [
        Engine.DDP,
        Engine.ZERO1,
        Engine.NONE,
    ]
    assert make_plan(compose("recipe=gpt/tiny", "strategy=sharding")[0]).engine == "fsdp"


def test_clearing_the_cache_changes_no_plan():
    cfgs = [
        compose("recipe=gpt/tiny", "strategy=hybrid")[0],
        compose("recipe=gpt/tiny", "strategy=pp", "hardware.devices_per_node=2", "strategy.recompute=full")[
            0
        ],
    ]
    before = [make_plan(c).to_dict() for c in cfgs]
    assert PLAN_CACHE.units and PLAN_CACHE.chunks
    PLAN_CACHE.clear()
    assert not PLAN_CACHE.units and not PLAN_CACHE.unit_class and not PLAN_CACHE.groups.entries
    assert [make_plan(c).to_dict() for c in cfgs] == before


def _imports(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fleetwise.plan"):
            yield node.module, [a.name for a in node.names]


def test_nothing_outside_the_planner_imports_its_private_names():
    files = [p for p in PACKAGE.rglob("*.py") if "plan" not in p.relative_to(PACKAGE).parts[:1]]
    files += list((REPO / "tests").rglob("*.py")) + list((REPO / "scripts").rglob("*.py"))
    wrong = [
        f"{p.relative_to(REPO)}: from {module} import {name}"
        for p in files
        for module, names in _imports(p)
        for name in names
        if name.startswith("_")
    ]
    assert not wrong, wrong
