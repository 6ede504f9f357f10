"""The trained model as an MLflow model, and the training data as a dataset input, from one real
job: a tiny GPT under ZeRO-3 on 2 ranks (so the logged weights are consolidated from FSDP shards),
checkpoints at steps 2 and 3, logging to a local sqlite store in a temp dir.

A fresh Python process (no state of the launcher) loads what was logged and must reproduce the
run's `eval/loss` on the same batch: the registered weights (safetensors, through
`fleetwise.load_model("models:/...")`), and the pyfunc that only references the sharded checkpoint
(what a model above tracking.model_max_bytes gets). Neither is a pickle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import run_cli

pytestmark = pytest.mark.slow

NAME = "tiny-gpt"
JOB = (
    "recipe=gpt/tiny",
    "strategy=sharding",
    "strategy.sharding_stage=3",
    "hardware.devices_per_node=2",
    "train.steps=3",
    "checkpoint.enabled=true",
    "checkpoint.interval=2",
    f"tracking.register_as={NAME}",
)


def plant_orphan(root: Path) -> str:
    """A run of the store whose launcher was SIGKILLed an hour ago (tracking.json: its dead pid, its
    last heartbeat), left RUNNING: the next `fleetwise train` on the store marks it KILLED."""
    from helpers.tracking_support import make_run_dir, write_steps

    from fleetwise.tracking.run_tracker import RunTracker
    from fleetwise.tracking.spool import load_state, save_state

    run_dir = make_run_dir(root, "orphan")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root.resolve() / 'mlflow.db'}")
        t = RunTracker(
            run_dir, experiment="orphans", run_name="orphan", params={}, tags={}, artifacts=[], system_metrics=False
        )
        run_id = t.start()
        write_steps(run_dir, range(1, 3))
        t.poll()
        t._lock.release()  # as the kernel does for a killed process
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    state = load_state(run_dir)
    state.launcher_pid, state.heartbeat_ms = dead.pid, state.heartbeat_ms - 3_600_000
    save_state(run_dir, state)
    return run_id


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    orphan = plant_orphan(root)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    r = subprocess.run(
        [str(Path(sys.executable).parent / "fleetwise"), "train", *JOB, f"run.dir={root / 'run'}"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    from mlflow import MlflowClient

    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fleetwise").experiment_id])
    r.orphan = orphan
    return root, uri, client, run, r


def fresh_process(root: Path, uri: str, script: str) -> dict:
    """Run `script` in a new interpreter against the store; it prints one JSON object."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    r = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


LOAD_AND_EVALUATE = """
import json, sys, torch, yaml, mlflow, mlflow.pyfunc
import fleetwise
from fleetwise.config.run import RunConfig
from fleetwise.models.transformer import lm_loss
from fleetwise.tracking.models import eval_batch

uri = sys.argv[1] if len(sys.argv) > 1 else "models:/{name}/1"
model = fleetwise.load_model(uri)
files = mlflow.artifacts.download_artifacts(uri)
cfg = RunConfig.model_validate(yaml.safe_load(open(files + "/data/fleetwise/config.yaml")))
batch = eval_batch(cfg)
model.eval()
with torch.no_grad():
    weights_loss = float(lm_loss(model(batch["tokens"]), batch["labels"]))
ref = mlflow.pyfunc.load_model("{reference}")
logits = torch.from_numpy(ref.predict(batch["tokens"].numpy()))
print(json.dumps({{"weights": weights_loss, "reference": float(lm_loss(logits, batch["labels"]))}}))
"""


def test_logged_model_reproduces_the_eval_loss_in_a_fresh_process(job):
    root, uri, client, run, r = job
    eval_loss = run.data.metrics["eval/loss"]
    assert "model logged (weights" in r.stderr and f"registered as {NAME} v1" in r.stderr
    assert "pickle" not in (r.stdout + r.stderr).lower()  # MLflow's warning about pickled models
    # what a model above tracking.model_max_bytes gets: a pyfunc referencing the sharded checkpoint
    from fleetwise.tracking.models import log_model

    last = root / "run" / "checkpoints" / "step_00000003"
    ref = log_model(uri, run.info.run_id, last, max_bytes=0)
    assert ref["kind"] == "reference" and "eval_loss" not in ref
    import mlflow

    mlflow.set_tracking_uri(uri)
    ref_dir = Path(mlflow.artifacts.download_artifacts(ref["model_uri"], dst_path=str(root / "ref")))
    sizes = {p.name: p.stat().st_size for p in ref_dir.rglob("*") if p.is_file()}
    assert max(sizes.values()) < 64 * 1024, sizes  # no weights copied, only the reference and config
    pointer = json.loads(next(ref_dir.rglob("checkpoint_reference.json")).read_text())
    assert pointer["checkpoint"] == str(last.resolve())

    got = fresh_process(root, uri, LOAD_AND_EVALUATE.format(name=NAME, reference=ref["model_uri"]))
    assert got["weights"] == pytest.approx(eval_loss, abs=1e-6)
    assert got["reference"] == pytest.approx(eval_loss, abs=1e-6)
    # the loss of a trained model, not of a fresh one: below the first step's training loss
    first = client.get_metric_history(run.info.run_id, "train/loss")[0].value
    assert eval_loss < first


def test_the_run_of_a_killed_launcher_is_marked_killed_by_the_next_train(job):
    _, _, client, _, r = job
    orphan = client.get_run(r.orphan)
    assert orphan.info.status == "KILLED" and "fleetwise.last_seen" in orphan.data.tags
    assert f"run {r.orphan}" in r.stderr and "marked KILLED" in r.stderr


def test_model_has_signature_config_and_registry_version(job):
    root, uri, client, run, _ = job
    version = client.get_model_version(NAME, "1")
    assert version.run_id == run.info.run_id
    import mlflow
    from mlflow.models import get_model_info

    mlflow.set_tracking_uri(uri)
    info = get_model_info(f"models:/{NAME}/1")
    (inp,) = info.signature.inputs.inputs
    (out,) = info.signature.outputs.inputs
    assert (str(inp.type), inp.shape) == ("int64", (-1, 32))  # tokens [batch, seq_len]
    assert (str(out.type), out.shape) == ("float32", (-1, 32, 256))  # logits [batch, seq, vocab]
    files = Path(mlflow.artifacts.download_artifacts(f"models:/{NAME}/1", dst_path=str(root / "v1")))
    assert "strategy:" in (files / "data" / "fleetwise" / "config.yaml").read_text()
    assert json.loads((files / "data" / "fleetwise" / "plan.json").read_text())["world_size"] == 2
    assert (files / "data" / "fleetwise" / "model.safetensors").exists()
    assert not [p for p in files.rglob("*") if p.suffix in (".pkl", ".pt", ".pth")]  # nothing to unpickle


def test_checkpoint_export_logs_a_model_of_that_step(job):
    root, uri, client, run, _ = job
    r = run_cli(
        "checkpoint",
        "export",
        str(root / "run" / "checkpoints" / "step_00000002"),
        "--log-model",
        "--register",
        NAME,
        cwd=root,
    )
    assert r.returncode == 0, r.stderr
    assert f"registered as {NAME} v2" in r.stderr
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/loss")}
    assert set(history) == {2, 3} and history[2] != history[3]
    assert client.get_model_version(NAME, "2").run_id == run.info.run_id


def test_the_training_data_is_a_dataset_input(job):
    _, _, _, run, _ = job
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.name == "synthetic-gpt-seed1234" and inp.dataset.source_type == "code"
    assert json.loads(inp.dataset.profile)["seed"] == 1234
    assert {t.key: t.value for t in inp.tags}["mlflow.data.context"] == "training"
    from helpers.config import compose

    cfg, _ = compose(*JOB)
    from fleetwise.tracking.datasets import describe_data

    assert inp.dataset.digest == describe_data(cfg).digest


def test_export_log_model_without_a_tracked_run_exits_2(tmp_path, job):
    root = job[0]
    lonely = tmp_path / "copy" / "checkpoints"
    lonely.mkdir(parents=True)
    import shutil

    ckpt = shutil.copytree(root / "run" / "checkpoints" / "step_00000003", lonely / "step_00000003")
    r = run_cli("checkpoint", "export", str(ckpt), "--log-model", cwd=tmp_path)
    assert r.returncode == 2 and "has no MLflow run" in r.stderr and "Traceback" not in r.stderr
