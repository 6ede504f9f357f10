"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Every rank writes only what it holds (FSDP shards, TP shards, its pipeline stages); parameter
names are the model's own (no DDP/FSDP/checkpoint-wrapper prefixes, layers keyed by index), so a
checkpoint loads under any other layout. A checkpoint directory appears under its final name only
once complete: ranks write into `<name>.tmp`, and rank 0 renames it after everyone finished.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

STEP_PREFIX = "step_"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"{STEP_PREFIX}{step:08d}"


def model_state(parts) -> dict:
    state: dict = {}
    for part in parts:
        state.update(get_model_state_dict(part))
    return state


def save(run_dir: Path, step: int, parts, *, meta: dict | None = None, keep: int = 2) -> Path:
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save({"model": model_state(parts)}, checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / "fleetwise.json").write_text(json.dumps({"step": step, **(meta or {})}, indent=2))
        tmp.rename(final)
        prune(run_dir, keep)
    dist.barrier()
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name.startswith(STEP_PREFIX)
        and not p.name.endswith(".tmp")
        and (p / "fleetwise.json").exists()
    )


def prune(run_dir: Path, keep: int) -> None:
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def export(checkpoint: Path, out: Path) -> Path:
    """Consolidate a sharded checkpoint into one torch.save file ({"model": {name: tensor}})."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(out))
    return out
