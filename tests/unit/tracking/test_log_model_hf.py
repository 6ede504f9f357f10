"""A Llama-family run's logged model (tracking.log_model=true) brings its Hugging Face directory
along: the run's `hf_model` artifacts, which transformers loads and which compute the run's logits.
Its eval/loss on packed documents (data=jsonl) is the training loss's: with their positions."""

from __future__ import annotations

import pytest
import torch
from helpers.tokenizers_tiny import write_jsonl, write_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # mlflow logs a model: ~20 s of CPU


def test_llama_model_is_logged_with_its_hugging_face_directory(tmp_path, monkeypatch):
    import mlflow
    import torch.distributed.checkpoint as dcp
    from mlflow import MlflowClient

    from fleetwise.config.validate import load_config
    from fleetwise.models.transformer import lm_loss
    from fleetwise.runtime.modeling import build_model, build_source
    from fleetwise.tracking.models import log_model

    monkeypatch.chdir(tmp_path)
    write_tokenizer(tmp_path / "tok")
    docs = [
        {"text": "the quick brown fox"},
        {"prompt": "question: what is two plus two?", "response": " four"},
    ]
    data = write_jsonl(tmp_path / "d.jsonl", docs * 4)
    cfg = load_config(
        [
            "recipe=llama/tiny",
            "model.num_layers=1",
            "data=jsonl",
            f"data.path={data}",
            f"data.tokenizer={tmp_path / 'tok'}",
        ]
    )
    model = build_model(cfg).eval()
    weights = tmp_path / "run" / "model"  # a run's final weights: DCP shards, no config beside them
    dcp.save(
        {f"model.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=str(weights), no_dist=True
    )
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = MlflowClient(uri).create_run("0").info.run_id
    params = sum(p.numel() for p in model.parameters())
    logged = log_model(uri, run_id, weights, cfg=cfg, plan={"params": params}, step=1)

    assert logged["kind"] == "weights" and logged["hf_uri"] == f"runs:/{run_id}/hf_model"
    mlflow.set_tracking_uri(uri)
    hf_dir = mlflow.artifacts.download_artifacts(logged["hf_uri"], dst_path=str(tmp_path / "dl"))
    exported = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    batch = build_source(cfg).batch(torch.arange(2).numpy())
    with torch.no_grad():
        diff = (exported(batch["tokens"]).logits - model(batch["tokens"])).abs().max().item()
        packed = lm_loss(model(batch["tokens"], batch["positions"]), batch["labels"]).item()
    assert diff <= 1e-5, diff
    # eval/loss: the first min(global batch, 32) = 8 packed rows, with their documents' positions
    rows = build_source(cfg).batch(torch.arange(8).numpy())
    with torch.no_grad():
        expected = lm_loss(model(rows["tokens"], rows["positions"]), rows["labels"]).item()
    assert abs(logged["eval_loss"] - expected) <= 1e-6 and packed > 0
