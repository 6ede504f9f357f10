"""`fleetwise.load_model(path)`: a trained model back as a plain `nn.Module`, in one line.

    import fleetwise
    model = fleetwise.load_model("outputs/2026-11-24/05-30-00-123456")   # or a checkpoint directory

`path` is a run directory (its final weights: the newest complete checkpoint of a job that
checkpoints, else `model/` -- the weights the job logs to MLflow), one checkpoint directory, or a
Hugging Face model directory of a Llama-family model (config.json + *.safetensors: fleetwise's
Llama with those weights; families/llama/weights.py), or a model fleetwise logged to MLflow: its
URI (`models:/NAME/1`, `runs:/RUN_ID/model`) or a downloaded copy (a directory with an `MLmodel`),
read without unpickling anything (a pickle planted in it is refused; tracking/models.py). The model is rebuilt from the run's `config.yaml`
(the same family code the ranks ran), its weights consolidated from the DCP shards through the
verified reader that `fleetwise checkpoint export` uses (checksums, allow-listed metadata), and
returned on the CPU in eval mode, whatever layout trained it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fleetwise.rundir import CONFIG_FILE, MODEL_DIR, read_config

if TYPE_CHECKING:
    from torch import nn


def weights_of(path: Path) -> tuple[Path, Path]:
    """(DCP directory holding the weights, directory holding the config.yaml) of a run or checkpoint."""
    from fleetwise.runtime.checkpoint_files import final_weights

    path = Path(path)
    if (path / ".metadata").exists():  # a checkpoint (its config is inside) or a run's model/
        config_home = path if (path / CONFIG_FILE).exists() else path.parent
        return path, config_home
    if not (path / CONFIG_FILE).exists():
        raise FileNotFoundError(
            f"{path} is neither a fleetwise run directory nor a checkpoint (no config.yaml)"
        )
    weights = final_weights(read_config(path), path)  # what the job itself logs as its model
    if weights is None:
        raise FileNotFoundError(
            f"{path} holds no trained weights: no complete checkpoint and no {MODEL_DIR}/ "
            "(train with checkpoint.enabled=true, or tracking.log_model=true; strategy=ps jobs keep "
            "their parameters in the servers' shards under ps/)"
        )
    return weights, path


def load_model(path: str | Path) -> nn.Module:
    """The model a fleetwise run trained: rebuilt from its config, the final weights (or the newest
    checkpoint's) loaded, on the CPU, in eval mode. Raises FileNotFoundError when there are none."""
    import tempfile

    import torch

    from fleetwise.runtime.checkpoint import export
    from fleetwise.runtime.modeling import build_model

    if str(path).startswith(("models:/", "runs:/")):
        return _load_mlflow_model(str(path))
    if (Path(path) / "MLmodel").is_file():
        from fleetwise.tracking.models import load_logged_model

        return load_logged_model(Path(path))
    if (Path(path) / "config.json").is_file() and not (Path(path) / CONFIG_FILE).exists():
        from fleetwise.families.llama.weights import load_hf_model

        return load_hf_model(path)
    weights, config_home = weights_of(Path(path))
    cfg = read_config(config_home)
    model = build_model(cfg)
    with tempfile.TemporaryDirectory(prefix="fleetwise-load-") as tmp:
        state = torch.load(export(weights, Path(tmp) / "model.pt"), weights_only=True, map_location="cpu")
    model.load_state_dict(state)
    return model.eval()


def _load_mlflow_model(uri: str) -> nn.Module:
    """A model logged by fleetwise, downloaded from the tracking store (MLFLOW_TRACKING_URI, or the
    cwd's, as every fleetwise command) and read without unpickling anything."""
    import tempfile

    import mlflow

    from fleetwise.tracking.models import load_logged_model
    from fleetwise.tracking.store import configure_http, tracking_uri

    configure_http()
    mlflow.set_tracking_uri(tracking_uri())
    with tempfile.TemporaryDirectory(prefix="fleetwise-mlflow-model-") as tmp:
        return load_logged_model(Path(mlflow.artifacts.download_artifacts(uri, dst_path=tmp)))
