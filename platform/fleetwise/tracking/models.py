"""The trained model as an MLflow model, logged by the launcher at the end of a job and by
`fleetwise checkpoint export --log-model`.

Where the line is: a model whose fp32 parameters (the plan's count × 4 bytes) fit in
`tracking.model_max_bytes` (default 2 GiB) is consolidated from its DCP shards on the launching host,
rebuilt, evaluated and logged with `mlflow.pytorch.log_model`: weights, a signature, and the run's
config.yaml + plan.json as extra files (what rebuilds it). Consolidation holds the whole state in host
memory about twice (DCP's single file, then the module), which a host of a 1.3B+ model job cannot
be assumed to spare. A larger model is logged as a pyfunc that *references* the sharded checkpoint
(no bytes copied) with `load_from_checkpoint` as its loader: DCP reads into whatever model it is
given, a single-process one or a sharded one in a distributed job.

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
    `cfg` in this process when not given; a parallelised model gets only its own slices)."""
    import torch.distributed.checkpoint as dcp

    from fleetwise.runtime.modeling import build_model

    model = model if model is not None else build_model(cfg)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=str(checkpoint))  # in place: the state dict's tensors are the model's
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


class CheckpointReference:
    """pyfunc model of a model too large to consolidate: its artifacts are the config and a JSON
    reference to the sharded checkpoint; loading reads the checkpoint through `load_from_checkpoint`."""

    def load_context(self, context) -> None:
        import yaml

        from fleetwise.config.run import RunConfig

        ref = json.loads(Path(context.artifacts["reference"]).read_text())
        self.cfg = RunConfig.model_validate(yaml.safe_load(Path(context.artifacts["config"]).read_text()))
        self.model = load_from_checkpoint(Path(ref["checkpoint"]), self.cfg)

    def predict(self, context, model_input, params=None):
        import torch

        from fleetwise.runtime.modeling import model_spec

        spec = model_spec(self.cfg)
        if not isinstance(model_input, dict):
            model_input = {spec.inputs[0]: model_input}
        self.model.eval()
        with torch.no_grad():
            return self.model(*[torch.as_tensor(model_input[k]) for k in spec.inputs]).numpy()


def _pyfunc_reference():
    """CheckpointReference as an mlflow.pyfunc.PythonModel (mlflow is imported only here)."""
    import mlflow.pyfunc

    return type("CheckpointReferenceModel", (CheckpointReference, mlflow.pyfunc.PythonModel), {})


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
    # fleetwise itself must be importable where the model loads (the pickled module refers to it).
    import mlflow
    import torch

    return [f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}", "pyyaml", "numpy"]


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
    with mlflow.start_run(run_id=run_id):
        if model_bytes(plan) > limit:
            with tempfile.TemporaryDirectory(prefix="fleetwise-ref-") as tmp:
                ref = Path(tmp) / "checkpoint_reference.json"
                ref.write_text(
                    json.dumps(
                        {
                            "checkpoint": str(checkpoint),
                            "format": "torch.distributed.checkpoint",
                            "bytes_fp32": model_bytes(plan),
                            "loader": f"{__name__}.load_from_checkpoint",
                        },
                        indent=2,
                    )
                )
                info = mlflow.pyfunc.log_model(
                    name=MODEL_NAME,
                    python_model=_pyfunc_reference()(),
                    artifacts={"reference": str(ref), "config": extra[0]},
                    registered_model_name=register_as,
                    pip_requirements=_requirements(),
                    tags={"fleetwise.model": "reference"},
                )
            result["kind"] = "reference"
        else:
            import mlflow.pytorch

            model = consolidated_model(checkpoint, cfg)
            batch = eval_batch(cfg)
            loss = evaluate(model, cfg, batch)
            mlflow.log_metric(EVAL_METRIC, loss, step=step)
            info = mlflow.pytorch.log_model(
                model,
                name=MODEL_NAME,
                signature=_signature(model, cfg, batch),
                extra_files=extra,
                registered_model_name=register_as,
                pip_requirements=_requirements(),
                tags={"fleetwise.model": "weights"},
                # the module pickled by reference to fleetwise (installed where it loads); "pt2" would
                # trace one fixed input shape
                serialization_format="pickle",
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
