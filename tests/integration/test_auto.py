"""`fleetwise train strategy=auto`: a real 2-rank job on the layout the search chose, with the
choice in the run directory and in the MLflow run (tag + artifact)."""

from __future__ import annotations

import json

import pytest
from helpers.cli import run_cli
from helpers.runs import read_metrics

pytestmark = pytest.mark.slow


def test_train_strategy_auto_runs_the_winner_and_logs_the_choice(tmp_path):
    run_dir = tmp_path / "run"
    db = tmp_path / "mlflow.db"
    r = run_cli(
        "train",
        "recipe=gpt/tiny",
        "strategy=auto",
        "hardware.devices_per_node=2",
        "train.steps=3",
        "tracking.system_metrics=false",
        "tracking.log_model=false",
        "+tracking.tags.team=nlp",  # a user's own tag reaches the run
        f"run.dir={run_dir}",
        cwd=tmp_path,
        env={"MLFLOW_TRACKING_URI": f"sqlite:///{db}"},
        timeout=400,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "winner: strategy=hybrid" in r.stdout and "vs #1" in r.stdout
    search = json.loads((run_dir / "auto_search.json").read_text())
    override = search["override"]
    assert search["candidates"][0]["overrides"] == override
    # the ranks ran the winner: its degrees are in the resolved config they read
    from fleetwise import rundir

    cfg = rundir.read_config(run_dir)
    for item in override.split()[1:]:
        key, value = item.split("=")
        section, name = key.split(".")
        got = getattr(cfg.strategy if section == "strategy" else cfg.train, name)
        assert ("null" if got is None else str(got).lower()) == value.lower(), key
    assert cfg.strategy.name == "hybrid"
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("fleetwise").experiment_id])
    assert run.data.tags["fleetwise.auto_override"] == override
    assert run.data.tags["fleetwise.strategy"] == "auto"
    assert run.data.tags["team"] == "nlp"
    assert "auto_search.json" in [a.path for a in client.list_artifacts(run.info.run_id)]
