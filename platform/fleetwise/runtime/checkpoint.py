"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save, resume, reshard, export.

What a checkpoint holds: the model (parameters and buffers), the optimizer state, the step (which
is also the data position and the LR schedule's position: data and schedule are functions of the
step), each rank's RNG state, and the resolved config + plan that produced it.

Every rank writes only what it holds (FSDP shards, TP shards, its pipeline stages, its ZeRO-1
partition) under the model's own parameter names -- no DDP/FSDP/activation-checkpoint prefixes,
layers keyed by index -- so a checkpoint loads under any other layout and number of ranks: DCP
reads whatever slices the new layout needs. Only tensors are stored (no pickled Python objects);
the metadata is JSON.

Atomicity: ranks write into `<step_dir>.tmp`; after everyone finished, rank 0 writes
`fleetwise.json` (with every file's size, and a SHA-256 for checkpoints under 1 GiB) and renames
the directory. A directory without `.tmp` and with `fleetwise.json` is complete.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from fleetwise.runtime.checkpoint_files import (
    HASH_LIMIT_BYTES,
    META,
    checkpoint_dir,
    complete_checkpoints,
)

RNG_KEY = "rng.rank{rank}"
CUDA_RNG_KEY = "rng_cuda.rank{rank}"


def rng_state(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's RNG streams: the host's, and its GPU's (dropout and random init draw there)."""
    state = {RNG_KEY.format(rank=rank): torch.get_rng_state()}
    if device.type == "cuda":
        state[CUDA_RNG_KEY.format(rank=rank)] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], rank: int, device: torch.device) -> None:
    torch.set_rng_state(state[RNG_KEY.format(rank=rank)])
    cuda_key = CUDA_RNG_KEY.format(rank=rank)
    if device.type == "cuda" and cuda_key in state:
        torch.cuda.set_rng_state(state[cuda_key], device)


def _clean(name: str) -> str:
    from fleetwise.runtime.trainer import clean_name

    return clean_name(name)


def model_state(parts) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        state.update(get_model_state_dict(part))
    return {f"model.{k}": v for k, v in state.items()}


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Optimizer state is created lazily by the first step; make it exist (with lr 0, so parameters
    do not move) so that a checkpoint can be loaded into it in place."""
    if opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    saved = [g["lr"] for g in opt.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, saved, strict=True):
        g["lr"] = lr
    for p in params:
        p.grad = None


def optimizer_state(parts, optimizers, *, init: bool = False) -> dict[str, torch.Tensor]:
    """`state.<param name>.<key>` for the optimizer state this rank holds (the layout-independent
    form of DCP's flattened optimizer state dict; a ZeRO-1 rank holds only its partition)."""
    out: dict[str, torch.Tensor] = {}
    for part, opt in zip(parts, optimizers.local(), strict=True):
        if init:
            _init_optimizer_state(opt)
        names = {id(p): _clean(n) for n, p in part.named_parameters()}
        for p, st in opt.state.items():
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    out[f"state.{names[id(p)]}.{key}"] = value
    return out


def train_state(step: int, skipped: int) -> dict[str, torch.Tensor]:
    return {"train.step": torch.tensor(step), "train.skipped": torch.tensor(skipped)}


def save(run_dir: Path, step: int, trainer, *, keep: int) -> Path:
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {
        **model_state(trainer.model.parts),
        **optimizer_state(trainer.model.parts, trainer.optimizers),
        **train_state(step, trainer.skipped),
        **rng_state(rank, trainer.env.device),
    }
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()
    if rank == 0:
        for name in ("config.yaml", "plan.json"):
            shutil.copy2(run_dir / name, tmp / name)
        cfg = trainer.cfg
        meta = {
            "step": step,
            "world_size": dist.get_world_size(),
            "mesh": trainer.layout.as_dict(),
            "strategy": cfg.strategy.name,
            "recipe": cfg.recipe,
            "model": cfg.model.model_dump(mode="json"),
            "optimizer": cfg.optim.name,
            "saved_at": time.time(),
            "cuda_rng": trainer.env.device.type == "cuda",
            "files": _manifest(tmp),
        }
        (tmp / META).write_text(json.dumps(meta, indent=2))
        # A checkpoint of this step from an earlier job in this run dir (one resumed from an older
        # step) is superseded: set it aside under a `.tmp` name, which is never resumed from.
        replaced = final.with_name(final.name + ".replaced.tmp")
        if final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
            final.rename(replaced)
        tmp.rename(final)
        shutil.rmtree(replaced, ignore_errors=True)
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _manifest(directory: Path) -> dict[str, dict[str, Any]]:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    out = {}
    for p in files:
        entry: dict[str, Any] = {"size": p.stat().st_size}
        if total <= HASH_LIMIT_BYTES:
            entry["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
        out[str(p.relative_to(directory))] = entry
    return out


def load(path: Path, trainer) -> int:
    """Load a checkpoint into the trainer's (possibly differently laid out) model and optimizers.
    Returns the step to continue from."""
    meta = json.loads((path / META).read_text())
    parts, rank = trainer.model.parts, dist.get_rank()
    model = model_state(parts)
    optim = optimizer_state(parts, trainer.optimizers, init=True)
    train = train_state(0, 0)
    state = {**model, **optim, **train}
    same_world = meta["world_size"] == dist.get_world_size()
    if same_world:  # RNG streams are per rank: meaningful only for the same ranks
        rng = rng_state(rank, trainer.env.device)
        if trainer.env.device.type == "cuda" and not meta.get("cuda_rng", False):
            rng = {k: v for k, v in rng.items() if not k.startswith("rng_cuda.")}  # an older checkpoint
        state.update(rng)
    if meta.get("optimizer") != trainer.cfg.optim.name:  # a different optimizer starts fresh
        state = {k: v for k, v in state.items() if not k.startswith("state.")}
    dcp.load(state, checkpoint_id=str(path))
    for part in parts:
        prefix_free = {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}
        own = get_model_state_dict(part)
        set_model_state_dict(part, {k: prefix_free[k] for k in own})
    if same_world:
        set_rng_state(state, rank, trainer.env.device)
    step = int(state["train.step"])
    trainer.skipped = int(state["train.skipped"])
    trainer.optimizers.restore_schedule(step)
    return step


def export(checkpoint: Path, out: Path) -> Path:
    """Consolidate the model of a sharded checkpoint into one file: {parameter name: tensor}, the
    plain state dict of the fleetwise model (load it with `model.load_state_dict`)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = out.with_name(out.name + ".all.tmp")
    dcp_to_torch_save(str(checkpoint), str(tmp))
    full = torch.load(tmp, weights_only=True)
    tmp.unlink()
    model = {k[len("model.") :]: v for k, v in full.items() if k.startswith("model.")}
    torch.save(model, out)
    return out
