"""From the validated config to a model, its loss, its tensor-parallel plan and its data source."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fleetwise.config.run import RunConfig
from fleetwise.families import ModelSpec, family_of
from fleetwise.models.contract import check_model
from fleetwise.rundir import DATA_INDEX_FILE


def model_spec(cfg: RunConfig) -> ModelSpec:
    """Builder, loss, batch inputs and tensor-parallel plan of the config's model family."""
    return family_of(cfg.model).spec(cfg.model)


def build_meta_model(cfg: RunConfig) -> nn.Module:
    """The model's structure on the `meta` device: no memory, no values (see materialize),
    checked against the model contract before anything relies on it (ModelContractError lists
    every break, with its fix)."""
    family, spec = family_of(cfg.model), model_spec(cfg)
    with torch.device("meta"):
        model = spec.build(cfg.model)
    check_model(
        model,
        inputs=spec.inputs,
        num_layers=cfg.model.num_layers,
        pipeline=family.pipeline_refusal(cfg.model) is None and not family.chain_traced,
        tp_paths=_tp_plan_paths(spec),
    )
    return model


def _tp_plan_paths(spec: ModelSpec) -> list[str]:
    """The submodule paths of the family's tensor-parallel plan, with and without sequence parallelism."""
    if spec.tp_plan is None:
        return []
    return list(dict.fromkeys([*spec.tp_plan(False), *spec.tp_plan(True)]))


def materialize(
    part: nn.Module, device: torch.device, seed: int, *, params_on_host: bool = False, load_weights=None
) -> None:
    """Allocate a (possibly sharded) meta-built part on `device` -- only this rank's shards -- and
    fill it with its slice of the layout-invariant initial values (fleetwise.models.init), or of
    pretrained weights: `load_weights(part)` (ModelSpec.load_weights, e.g. Llama's model.init_from).
    params_on_host: parameters on the CPU, buffers on `device` (FSDP with CPU offload)."""
    from fleetwise.models.init import init_weights_

    part.to_empty(device=torch.device("cpu") if params_on_host else device)
    if load_weights is not None:
        load_weights(part)
    else:
        init_weights_(part, seed)
    if params_on_host and device.type != "cpu":
        for module in part.modules():
            for name, buf in module.named_buffers(recurse=False):
                setattr(module, name, buf.to(device))  # the buffer, replaced in place


def build_model(cfg: RunConfig) -> nn.Module:
    """The whole model on the host, with the initial values every layout starts from."""
    model = build_meta_model(cfg)
    materialize(model, torch.device("cpu"), cfg.train.seed, load_weights=model_spec(cfg).load_weights)
    return model


def build_source(cfg: RunConfig):
    """The sample source for the model family and data config (see fleetwise.data and the
    family's own `data` module). A source that packs from an index takes the launcher's, from the
    run directory (data=jsonl: `read_index`)."""
    source = family_of(cfg.model).source(cfg.model, cfg.data)
    if hasattr(source, "read_index") and cfg.run.dir is not None:
        source.read_index(Path(cfg.run.dir) / DATA_INDEX_FILE)
    return source
