"""The trained model as an MLflow model, logged by the launcher at the end of a job and by
`fleetwise checkpoint export --log-model`.

Loading a logged model never unpickles anything: the model is an MLflow pyfunc whose loader is this
module (`loader_module`, no pickled Python object in it) and whose data is
`data/fleetwise/`: `model.safetensors` (the weights, a format that holds tensors only), the run's
`config.yaml` and `plan.json`. Loading rebuilds the model from the config with fleetwise's own
builder (the same family code the ranks ran) and reads the weights into it. A model directory that
holds a pickle anyway, or names another loader, is refused before anything is read
(`check_model_dir`): a model from someone else's registry is code the moment it is unpickled, the
same risk the checkpoint reader refuses for DCP's `.metadata`.

Where the line is: a model whose fp32 parameters (the plan's count × 4 bytes) fit in
`tracking.model_max_bytes` (default 2 GiB) is consolidated from its DCP shards on the launching host,
rebuilt, evaluated and logged with its weights. Consolidation holds the whole state in host memory
about twice (DCP's single file, then the module), which a host of a 1.3B+ model job cannot be
assumed to spare. A larger model is logged as a *reference* to the sharded checkpoint
(`checkpoint_reference.json`, no bytes copied) loaded by `load_from_checkpoint`: DCP reads into
whatever model it is given, a single-process one or a sharded one in a distributed job.

The evaluation: the loss of the final weights (eval mode, no grad, fp32) on the first
min(global_batch_size, 32) samples of the job's data source, logged as `eval/loss` at the last step.
A fresh process that loads the logged model reproduces it on the same batch (`eval_batch`).

A Llama-family model logged with its weights also gets its Hugging Face directory (config.json,
safetensors shards and index: what `fleetwise checkpoint export --format hf` writes, streamed tensor
by tensor) as the run's artifact directory `hf_model`, beside the model, for
`transformers.AutoModelForCausalLM.from_pretrained` after `mlflow.artifacts.download_artifacts`.
A model above model_max_bytes gets neither copy: its reference points at the checkpoint, which
`checkpoint export --format hf` turns into the directory where it is needed.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from fleetwise.rundir import CONFIG_FILE, PLAN_FILE

MODEL_NAME = "model"  # runs:/<run_id>/model
HF_ARTIFACT = "hf_model"  # a Llama-family model's Hugging Face directory, an artifact of the run
LOADER_MODULE = __name__  # what MLflow imports to load the model: never a pickled object
DATA_DIR = "fleetwise"  # the pyfunc's data: <model>/data/fleetwise/
WEIGHTS_FILE = "model.safetensors"
REFERENCE_FILE = "checkpoint_reference.json"
# Files that are pickles by their name (torch.save, joblib, numpy object arrays): never in a model
# fleetwise logs, refused wherever they appear in one.
PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt", ".pth", ".ckpt", ".bin", ".joblib", ".npy", ".npz", ".cloudpickle")
EVAL_METRIC = "eval/loss"
EVAL_SAMPLES_MAX = 32
FP32 = 4


def model_bytes(plan: Any) -> int:
    """fp32 bytes of the whole model: what consolidation puts in one host's memory."""
    params = plan["params"] if isinstance(plan, dict) else plan.params
    return int(params) * FP32


def eval_batch(cfg) -> dict:
    """The evaluation batch: the data source's first min(global_batch_size, 32) samples."""
    import numpy as np

    from fleetwise.runtime.modeling import build_source

    source = build_source(cfg)
    n = min(cfg.train.global_batch_size, EVAL_SAMPLES_MAX)
    return source.batch(np.arange(n, dtype=np.int64) % source.num_samples)


def evaluate(model, cfg, batch: dict) -> float:
    """The model's mean loss on `batch` (eval mode: no dropout; no grad; fp32)."""
    import torch

    from fleetwise.runtime.modeling import model_spec

    spec = model_spec(cfg)
    model.eval()
    with torch.no_grad():
        # packed documents (data=jsonl) are evaluated as they trained: with their positions
        extra = {k: batch[k] for k in spec.optional_inputs if k in batch}
        out = model(*[batch[k] for k in spec.inputs], **extra)
        return float(spec.loss(out, batch[spec.label]))


def load_from_checkpoint(checkpoint: Path, cfg, model=None):
    """The loader of a sharded checkpoint: DCP reads the model's parameters into `model` (built from
    `cfg` in this process when not given; a parallelised model gets only its own slices), its
    metadata through the verified reader (a crafted `.metadata` is refused, never unpickled)."""
    import torch.distributed.checkpoint as dcp

    from fleetwise.runtime.checkpoint import VerifiedReader
    from fleetwise.runtime.modeling import build_model

    model = model if model is not None else build_model(cfg)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    # in place: the state dict's tensors are the model's
    dcp.load(state, storage_reader=VerifiedReader(Path(checkpoint)))
    return model


def consolidated_model(checkpoint: Path, cfg):
    """The model rebuilt from `cfg` with the weights of a DCP checkpoint, consolidated in memory."""
    import torch

    from fleetwise.runtime.checkpoint import export
    from fleetwise.runtime.modeling import build_model

    with tempfile.TemporaryDirectory(prefix="fleetwise-model-") as tmp:
        state = torch.load(export(checkpoint, Path(tmp) / "model.pt"), weights_only=True)
    model = build_model(cfg)
    model.load_state_dict(state)
    return model


def _config(checkpoint: Path):
    import yaml

    from fleetwise.config.run import RunConfig

    return RunConfig.model_validate(yaml.safe_load((checkpoint / CONFIG_FILE).read_text()))


class ModelRefused(RuntimeError):
    """A model directory holds something a model fleetwise logs never holds (a pickle, another loader)."""


def write_model_data(out: Path, config_files: list[str], *, model=None, reference: dict | None = None) -> Path:
    """The pyfunc's data directory: the weights as safetensors (or the checkpoint reference) beside
    the run's config.yaml and plan.json."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    for f in config_files:
        shutil.copy(f, out / Path(f).name)
    if model is not None:
        from safetensors.torch import save_model

        save_model(model, str(out / WEIGHTS_FILE))  # tied weights stored once, restored by load_model
    if reference is not None:
        (out / REFERENCE_FILE).write_text(json.dumps(reference, indent=2))
    return out


def check_model_dir(model_dir: Path) -> Path:
    """The data directory of a fleetwise MLflow model, after refusing anything in `model_dir` that
    loading could execute: a file that is a pickle (by its name, or by its first bytes: pickle's
    protocol mark, or torch.save's zip), or an MLmodel that loads through something else than
    this module (a pickled python_model, another flavor)."""
    import yaml

    model_dir = Path(model_dir)
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        if path.name == WEIGHTS_FILE and path.parent.name == DATA_DIR:
            continue  # parsed by safetensors, which reads tensors only
        if path.suffix.lower() in PICKLE_SUFFIXES or _pickled(path):
            raise ModelRefused(
                f"{path} is a pickle, which a model fleetwise logs never holds: refused without loading "
                "it (unpickling a file can run any code). Load only models logged by fleetwise, or "
                "rebuild it from its run directory: fleetwise.load_model(RUN_DIR)"
            )
    try:
        flavors = yaml.safe_load((model_dir / "MLmodel").read_text())["flavors"]
        loader = flavors["python_function"]["loader_module"]
        data = flavors["python_function"]["data"]
    except (OSError, KeyError, TypeError, yaml.YAMLError) as exc:
        raise ModelRefused(
            f"{model_dir} is not an MLflow model logged by fleetwise ({type(exc).__name__}: {exc}); "
            f"fleetwise loads models whose MLmodel names loader_module {LOADER_MODULE}"
        ) from None
    if loader != LOADER_MODULE or set(flavors) != {"python_function"}:
        raise ModelRefused(
            f"{model_dir}/MLmodel loads through {loader!r} (flavors {sorted(flavors)}), not "
            f"{LOADER_MODULE}: refused (another loader may unpickle or run code)"
        )
    data_dir = (model_dir / data).resolve()
    if not data_dir.is_relative_to(model_dir.resolve()) or not data_dir.is_dir():
        raise ModelRefused(f"{model_dir}/MLmodel names data {data!r} outside the model directory")
    return data_dir


def _pickled(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4)
    return (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5) or head == b"PK\x03\x04"


def load_model_data(data_dir: Path):
    """(model on the CPU in eval mode, its RunConfig) from a checked data directory."""
    import yaml

    from fleetwise.config.run import RunConfig
    from fleetwise.runtime.modeling import build_model

    cfg = RunConfig.model_validate(yaml.safe_load((data_dir / CONFIG_FILE).read_text()))
    if (data_dir / REFERENCE_FILE).exists():
        ref = json.loads((data_dir / REFERENCE_FILE).read_text())
        return load_from_checkpoint(Path(ref["checkpoint"]), cfg).eval(), cfg
    from safetensors.torch import load_model

    model = build_model(cfg)
    load_model(model, str(data_dir / WEIGHTS_FILE), strict=True, device="cpu")
    return model.eval(), cfg


def load_logged_model(model_dir: Path):
    """A downloaded fleetwise MLflow model as an `nn.Module` (fleetwise.load_model's path for one)."""
    return load_model_data(check_model_dir(model_dir))[0]


class FleetwisePyfunc:
    """What `mlflow.pyfunc.load_model` gives for a fleetwise model: `predict` runs the model on
    the inputs its family names (one array: the first input) and returns the output as numpy."""

    def __init__(self, model, cfg):
        self.model, self.cfg = model, cfg

    def predict(self, model_input, params=None):
        import torch

        from fleetwise.runtime.modeling import model_spec

        spec = model_spec(self.cfg)
        if not isinstance(model_input, dict):
            model_input = {spec.inputs[0]: model_input}
        with torch.no_grad():
            return self.model(*[torch.as_tensor(model_input[k]) for k in spec.inputs]).numpy()


def _load_pyfunc(data_path: str, model_config=None) -> FleetwisePyfunc:
    """MLflow's entry point (pyfunc `loader_module`): the model directory is checked first."""
    data_dir = Path(data_path)
    check_model_dir(data_dir.parent.parent)  # <model>/data/fleetwise
    return FleetwisePyfunc(*load_model_data(data_dir))


def _signature(model, cfg, batch: dict):
    import torch
    from mlflow.models import infer_signature

    from fleetwise.runtime.modeling import model_spec

    inputs = model_spec(cfg).inputs
    example = {k: batch[k][:1] for k in inputs}
    with torch.no_grad():
        out = model(*example.values()).float().numpy()
    arrays = {k: v.numpy() for k, v in example.items()}
    return infer_signature(arrays[inputs[0]] if len(inputs) == 1 else arrays, out)


def _requirements() -> list[str]:
    # Given, not inferred: MLflow's inference imports the model in a subprocess (seconds per job).
    # fleetwise itself must be importable where the model loads (it is the loader module).
    import mlflow
    import safetensors
    import torch

    return [
        f"torch=={torch.__version__.split('+')[0]}",
        f"mlflow=={mlflow.__version__}",
        f"safetensors=={safetensors.__version__}",
        "pyyaml",
        "numpy",
    ]


def log_model(
    uri: str,
    run_id: str,
    checkpoint: Path,
    *,
    cfg=None,
    plan: Any = None,
    register_as: str | None = None,
    max_bytes: int | None = None,
    step: int | None = None,
) -> dict[str, Any]:
    """Log the model in `checkpoint` (a DCP directory holding config.yaml and plan.json, or a
    run's final weights with `cfg`/`plan` given) to run `run_id`. Returns what was logged:
    {"kind": "weights"|"reference", "model_uri", "eval_loss" (weights only), "version" (registered)}."""
    import mlflow

    from fleetwise.tracking.store import configure_http

    checkpoint = Path(checkpoint).resolve()
    run_dir = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    cfg = cfg if cfg is not None else _config(checkpoint)
    if plan is None:
        saved = checkpoint / PLAN_FILE
        plan = json.loads((saved if saved.exists() else run_dir / PLAN_FILE).read_text())
    if step is None:  # a checkpoint knows its step; a job's final weights are at its last one
        meta = checkpoint / "fleetwise.json"
        step = json.loads(meta.read_text())["step"] if meta.exists() else cfg.train.steps
    limit = cfg.tracking.model_max_bytes if max_bytes is None else max_bytes
    extra = [str(p) for p in (run_dir / CONFIG_FILE, run_dir / PLAN_FILE) if p.exists()]
    if (checkpoint / CONFIG_FILE).exists():
        extra = [str(checkpoint / CONFIG_FILE), str(checkpoint / PLAN_FILE)]
    configure_http()
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # its "registered model ..." notes
    mlflow.set_tracking_uri(uri)
    result: dict[str, Any] = {}
    # The fluent API is what links a logged model to its run; the run's final status is set by the
    # tracker right after, so ending it here (FINISHED) is harmless.
    with mlflow.start_run(run_id=run_id), tempfile.TemporaryDirectory(prefix="fleetwise-model-") as tmp:
        logged = dict(
            name=MODEL_NAME,
            loader_module=LOADER_MODULE,
            registered_model_name=register_as,
            pip_requirements=_requirements(),
        )
        if model_bytes(plan) > limit:
            reference = {
                "checkpoint": str(checkpoint),
                "format": "torch.distributed.checkpoint",
                "bytes_fp32": model_bytes(plan),
                "loader": f"{__name__}.load_from_checkpoint",
            }
            data = write_model_data(Path(tmp) / DATA_DIR, extra, reference=reference)
            info = mlflow.pyfunc.log_model(
                data_path=str(data), tags={"fleetwise.model": "reference"}, **logged
            )
            result["kind"] = "reference"
        else:
            model = consolidated_model(checkpoint, cfg)
            batch = eval_batch(cfg)
            loss = evaluate(model, cfg, batch)
            mlflow.log_metric(EVAL_METRIC, loss, step=step)
            data = write_model_data(Path(tmp) / DATA_DIR, extra, model=model)
            info = mlflow.pyfunc.log_model(
                data_path=str(data),
                signature=_signature(model, cfg, batch),
                tags={"fleetwise.model": "weights"},
                **logged,
            )
            result.update(kind="weights", eval_loss=loss)
            from fleetwise.families import family_of

            if family_of(cfg.model).exports_hf:
                result["hf_uri"] = _log_hf_dir(checkpoint, cfg, run_id)
    result["model_uri"] = info.model_uri
    if register_as and info.registered_model_version is not None:
        result["version"] = int(info.registered_model_version)
    return result


def _log_hf_dir(checkpoint: Path, cfg, run_id: str) -> str:
    """The checkpoint exported as a Hugging Face directory, logged as the run's `hf_model` artifacts."""
    import mlflow

    from fleetwise.runtime.checkpoint import export_hf

    with tempfile.TemporaryDirectory(prefix="fleetwise-hf-") as tmp:
        out = Path(tmp) / HF_ARTIFACT
        export_hf(checkpoint, out, cfg=cfg)
        mlflow.log_artifacts(str(out), artifact_path=HF_ARTIFACT)
    return f"runs:/{run_id}/{HF_ARTIFACT}"
