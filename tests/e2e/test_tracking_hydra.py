"""A real Hydra multirun (a tiny app in a subprocess) with MlflowSweepCallback registered the way
conf/config.yaml registers it: one parent run, one child per sweep point, and a parent that still
ends (FAILED) when a failing job stops the sweep before on_multirun_end."""

from __future__ import annotations

import os
import subprocess
import sys

from fleetwise.tracking.sweep import parent_run_id_for

HYDRA_APP = """
import json, pathlib
import hydra
from hydra.core.hydra_config import HydraConfig
from fleetwise.tracking.run_tracker import RunTracker
from fleetwise.tracking.sweep import parent_run_id_from_hydra

@hydra.main(version_base=None, config_path=".", config_name="config")
def app(cfg):
    out = pathlib.Path(HydraConfig.get().runtime.output_dir)
    t = RunTracker(out, experiment="hydra", run_name=f"job-{cfg.strategy}", params={"strategy": cfg.strategy},
                   tags={"fleetwise.strategy": cfg.strategy}, artifacts=[], parent_run_id=parent_run_id_from_hydra(),
                   system_metrics=False)
    t.start()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "perf/tokens_per_s": 100.0}) + "\\n")
    if cfg.strategy == "bad":
        t.finish("FAILED", error="bad strategy")
        raise RuntimeError("bad strategy")
    t.finish("FINISHED")

app()
"""

HYDRA_CONFIG = """
strategy: dp
tracking: {enabled: true, experiment: hydra}
hydra:
  sweep:
    dir: multirun/${now:%H-%M-%S-%f}   # microseconds: every resolution must agree
  callbacks:
    mlflow_sweep:
      _target_: fleetwise.tracking.sweep.MlflowSweepCallback
"""


def test_a_real_hydra_multirun_nests_its_jobs_and_a_failing_job_fails_the_parent(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    (tmp_path / "app.py").write_text(HYDRA_APP)
    (tmp_path / "config.yaml").write_text(HYDRA_CONFIG)
    done = subprocess.run(
        [sys.executable, "app.py", "-m", "strategy=dp,sharding,bad"],
        cwd=tmp_path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0 and "bad strategy" in done.stderr  # Hydra stops the sweep at the bad job
    (sweep_dir,) = (tmp_path / "multirun").iterdir()
    parent_id = parent_run_id_for(sweep_dir)
    assert parent_id, done.stderr[-2000:]
    store = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    parent = store.get_run(parent_id)
    assert parent.info.status == "FAILED"  # ended at exit although on_multirun_end never came
    kids = store.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert sorted((r.info.run_name, r.info.status) for r in kids) == [
        ("job-bad", "FAILED"),
        ("job-dp", "FINISHED"),
        ("job-sharding", "FINISHED"),
    ]
    assert (sweep_dir / "compare.png").exists() and "job-sharding" in (sweep_dir / "compare.md").read_text()
