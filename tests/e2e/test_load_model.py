"""`fleetwise.load_model(run_dir)`: the public one-liner that gives back a trained model."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

LOAD = """
import json, sys, torch
import fleetwise
from fleetwise import rundir
from fleetwise.models.transformer import lm_loss
from fleetwise.tracking.models import eval_batch

model = fleetwise.load_model(sys.argv[1])
batch = eval_batch(rundir.read_config(sys.argv[1]))
with torch.no_grad():
    loss = float(lm_loss(model(batch["tokens"]), batch["labels"]))
devices = sorted({str(p.device) for p in model.parameters()})
print(json.dumps({"loss": loss, "training": model.training, "devices": devices, "type": type(model).__name__}))
"""


def test_load_model_gives_the_trained_model_on_cpu_in_eval_mode(tmp_path):
    """A ZeRO-3 job on 2 ranks, no checkpoints: load_model(run_dir) in a fresh process rebuilds the
    model from the final weights' shards and reproduces the eval/loss the launcher logged to MLflow
    for them; a run directory without weights is refused with what to set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    run_dir = tmp_path / "run"
    job = [
        "recipe=gpt/tiny",
        "strategy=sharding",
        "strategy.sharding_stage=3",
        "hardware.devices_per_node=2",
        "train.steps=3",
        f"run.dir={run_dir}",
    ]
    exe = str(Path(sys.executable).parent / "fleetwise")
    r = subprocess.run(
        [exe, "train", *job], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (run_dir / "model" / ".metadata").exists() and not (run_dir / "checkpoints").exists()
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("fleetwise").experiment_id])
    logged = run.data.metrics["eval/loss"]

    got = subprocess.run(
        [sys.executable, "-c", LOAD, str(run_dir)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    assert out["loss"] == pytest.approx(logged, abs=1e-6)
    assert out["training"] is False and out["devices"] == ["cpu"] and out["type"] == "GPT"

    import fleetwise

    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(run_dir / "config.yaml", empty / "config.yaml")
    with pytest.raises(FileNotFoundError, match="checkpoint.enabled=true"):
        fleetwise.load_model(empty)
