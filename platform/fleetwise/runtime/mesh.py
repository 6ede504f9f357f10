"""Process group start-up and the one 4D DeviceMesh every parallelism uses."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fleetwise.config.layout import MESH_DIMS, Layout
from fleetwise.config.run import RunConfig


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    restart: int  # torchrun's restart count of this worker group (0 on the first attempt)


def init_distributed(cfg: RunConfig) -> DistEnv:
    """Join the process group torchrun prepared (env://), with the configured collective timeout:
    a collective that hangs (e.g. a peer died without the group noticing) becomes an error."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if cfg.hardware.device_type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 training uses TF32 (the planner's fp32 peak)
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend=cfg.hardware.backend,
            timeout=timedelta(seconds=cfg.launch.collective_timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return DistEnv(rank, world, local, device, restart)


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """Mesh dims (dp, pp, sharding, mp), outermost first -- see config/layout.py for why mp and
    sharding are innermost (consecutive ranks, one machine) and dp outermost."""
    assert layout.world_size == dist.get_world_size(), (layout, dist.get_world_size())
    return init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
