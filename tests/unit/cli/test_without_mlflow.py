"""fleetwise where MLflow is not installed (a GPU image with torch and no MLflow): a job with tracking
on is refused before it starts, naming the fix; with tracking off nothing asks for MLflow."""

from __future__ import annotations

import sys

import pytest

from fleetwise.cli import main


@pytest.fixture
def no_mlflow(monkeypatch):
    for name in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` raises, find_spec says absent


def test_tracking_on_without_mlflow_is_refused_before_the_job_starts(no_mlflow, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["train", "recipe=gpt/tiny", "hardware.devices_per_node=1", f"run.dir={run_dir}"])
    err = capsys.readouterr()
    assert code == 2, err
    text = err.out + err.err
    assert (
        "tracking.enabled" in text and "MLflow is not installed" in text and "tracking.enabled=false" in text
    )
    assert "Traceback" not in text
    assert not run_dir.exists() or not any(run_dir.iterdir())  # nothing started


def test_tracking_off_needs_no_mlflow(no_mlflow):
    from fleetwise.launcher.preflight import machine_problems, preflight

    pf = preflight(
        ["recipe=gpt/tiny", "hardware.devices_per_node=1", "tracking.enabled=false"], launching=True
    )
    problems, _ = machine_problems(pf)
    assert problems == []
    assert sys.modules["mlflow"] is None  # planning and the checks imported nothing of it
