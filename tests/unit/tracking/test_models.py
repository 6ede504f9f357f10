"""A logged model loads without unpickling anything: safetensors weights + the run's config, read by
fleetwise's own builder behind an MLflow pyfunc whose loader is fleetwise's module; a pickle planted
in a model directory, or an MLmodel naming another loader, is refused before anything executes."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import yaml
from helpers.config import compose

import fleetwise
from fleetwise import rundir
from fleetwise.runtime.modeling import build_model
from fleetwise.tracking.models import DATA_DIR, LOADER_MODULE, ModelRefused, write_model_data


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trained-looking gpt/tiny saved as fleetwise logs it (mlflow.pyfunc.save_model, no server)."""
    import mlflow.pyfunc

    root = tmp_path_factory.mktemp("model")
    cfg, problems = compose("recipe=gpt/tiny")
    assert not problems
    torch.manual_seed(7)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not the seed's init: the weights must come from the file
    rundir.write_config(root, cfg)
    (root / "plan.json").write_text('{"world_size": 1}\n')
    data = write_model_data(root / "staging" / DATA_DIR, [str(root / "config.yaml"), str(root / "plan.json")], model=model)
    mlflow.pyfunc.save_model(str(root / "m"), loader_module=LOADER_MODULE, data_path=str(data), pip_requirements=[])
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
    with torch.no_grad():
        logits = model.eval()(tokens)
    return root / "m", tokens, logits


def test_a_logged_model_holds_no_pickle_and_loads_through_fleetwise_and_mlflow(saved):
    import mlflow.pyfunc

    model_dir, tokens, logits = saved
    files = sorted(p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*") if p.is_file())
    assert f"data/{DATA_DIR}/model.safetensors" in files and f"data/{DATA_DIR}/config.yaml" in files
    assert not [f for f in files if f.endswith((".pkl", ".pt", ".pth"))], files
    flavor = yaml.safe_load((model_dir / "MLmodel").read_text())["flavors"]
    assert set(flavor) == {"python_function"} and flavor["python_function"]["loader_module"] == LOADER_MODULE

    model = fleetwise.load_model(model_dir)
    assert not model.training
    with torch.no_grad():
        assert torch.equal(model(tokens), logits)
    predicted = mlflow.pyfunc.load_model(str(model_dir)).predict(tokens.numpy())
    assert torch.equal(torch.from_numpy(predicted), logits)


@pytest.mark.parametrize(
    "plant",
    ["python_model.pkl", "data/fleetwise/weights", "data/fleetwise/extra.pt", "MLmodel:mlflow.pytorch"],
)
def test_a_planted_pickle_or_foreign_loader_is_refused_without_running(saved, tmp_path, plant):
    import shutil

    import mlflow.pyfunc

    model_dir = Path(shutil.copytree(saved[0], tmp_path / "m"))
    marker = tmp_path / "pwned"
    if plant.startswith("MLmodel:"):
        spec = yaml.safe_load((model_dir / "MLmodel").read_text())
        spec["flavors"]["python_function"]["loader_module"] = plant.split(":")[1]
        (model_dir / "MLmodel").write_text(yaml.safe_dump(spec))
        match = "mlflow.pytorch"
    else:
        (model_dir / plant).write_bytes(pickle.dumps(_Payload(marker)))
        match = "is a pickle"
    with pytest.raises(ModelRefused, match=match):
        fleetwise.load_model(model_dir)
    if not plant.startswith("MLmodel:"):  # MLflow itself goes through fleetwise's loader, which refuses too
        with pytest.raises(ModelRefused):
            mlflow.pyfunc.load_model(str(model_dir))
    assert not marker.exists()
