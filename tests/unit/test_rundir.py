"""The run-directory contract (fleetwise/rundir.py): one home for what crosses the process boundary."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from helpers.config import compose
from helpers.repo import REPO

from fleetwise import rundir
from fleetwise.plan import Plan, make_plan
from fleetwise.rundir import Metric, Summary


@pytest.mark.parametrize(
    "overrides",
    [
        ("recipe=gpt/tiny",),
        ("recipe=gpt/tiny", "strategy=hybrid", "strategy.pp_degree=2", "strategy.mp_degree=2"),
        ("recipe=ctr/tiny", "strategy=ps"),
        ("recipe=gpt/gpt3_175b",),
    ],
)
def test_the_plan_round_trips_through_its_json_file(tmp_path, overrides):
    cfg, problems = compose(*overrides)
    assert cfg is not None, problems
    plan = make_plan(cfg)
    rundir.write_plan(tmp_path, plan)
    back = rundir.read_plan(tmp_path)
    assert isinstance(back, Plan) and back == plan
    # what `plan --json` adds beyond the plan (remedies) is ignored, not an error
    assert Plan.from_dict({**plan.to_dict(), "remedies": []}) == plan
    rundir.write_config(tmp_path, cfg)
    assert rundir.read_config(tmp_path) == cfg


def test_run_dir_files_are_written_atomically_with_the_command_line(tmp_path):
    cfg, _ = compose("recipe=gpt/tiny")
    run_dir = tmp_path / "run"
    rundir.write_run_dir(run_dir, cfg, make_plan(cfg), ["recipe=gpt/tiny", "train.steps=3"])
    names = sorted(p.name for p in run_dir.iterdir())
    assert names == sorted([rundir.COMMAND_FILE, rundir.CONFIG_FILE, rundir.LOGS_DIR, rundir.PLAN_FILE])
    assert (run_dir / rundir.COMMAND_FILE).read_text() == "fleetwise train recipe=gpt/tiny train.steps=3\n"
    rundir.append_record(run_dir, {"step": 1, Metric.LOSS: 2.5})
    assert json.loads(rundir.metrics_path(run_dir).read_text()) == {"step": 1, "train/loss": 2.5}


def _contract_strings() -> set[str]:
    names = {
        rundir.CONFIG_FILE,
        rundir.PLAN_FILE,
        rundir.COMMAND_FILE,
        rundir.METRICS_FILE,
        rundir.TRACKING_FILE,
        rundir.PS_SUMMARY_FILE,
        rundir.LAUNCHER_LOG,
    }
    for cls in (Metric, Summary):
        names |= {v for k, v in vars(cls).items() if k.isupper()}
    return names


def test_file_and_metric_names_are_spelled_only_in_rundir():
    """A module that writes 'perf/tokens_per_s' or 'metrics.jsonl' itself can drift from its
    readers: every product module and script uses the constants (docstrings may mention names)."""
    names = _contract_strings()
    offenders = []
    for path in [*(REPO / "platform").rglob("*.py"), *(REPO / "scripts").glob("*.py")]:
        if path.name == "rundir.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings:
                offenders.append(f"{Path(path).relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not offenders, "\n".join(offenders)
