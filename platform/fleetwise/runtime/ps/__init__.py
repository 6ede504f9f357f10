"""Parameter-server training (`strategy=ps`) on torch.distributed.rpc (TensorPipe), seeds/004.

Entry contract: `run(cfg, run_dir)` is called once in every process of a torchrun launch of
`num_trainers + num_servers` processes, after torchrun has set RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. `cfg` is the resolved, validated RunConfig (the one
in `run_dir/config.yaml`). Roles (roles.py): ranks 0..T-1 are trainers 0..T-1 (global rank 0 is
trainer 0, the only writer of `run_dir/metrics.jsonl` and `run_dir/ps_summary.json`), ranks
T..T+S-1 are servers 0..S-1. `run` returns normally in every process when training finished and
the servers have shut down; it raises (non-zero exit) on any failure. It writes nothing to
stdout/stderr redirection itself: the caller points them at `run_dir/logs/rank_N.log`
(`python -m fleetwise.runtime.ps RUN_DIR` does it).

With `checkpoint.enabled=true` each server also writes its shard to `run_dir/ps/server_<i>.pt` at
the end, and when torchrun stops it with SIGTERM (the last consistent state: a trainer that dies
mid-step leaves no half-applied update).

Why TensorPipe RPC: it is the request/response engine that ships with PyTorch (the design's engine
choice for the parameter server). c10d point-to-point (send/recv) would need every pull and push
matched by a receive posted in advance on the server, which is the opposite of a server that
answers whichever trainer asks.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from pathlib import Path

from fleetwise.config.run import RunConfig


def run(cfg: RunConfig, run_dir: Path) -> None:
    """Run this process's role (trainer or server) of a parameter-server job."""
    import torch
    import torch.distributed.rpc as rpc

    from fleetwise.config.model import CTRModel
    from fleetwise.config.strategy import PSStrategy
    from fleetwise.runtime.ps.roles import log, role_from_env

    if not isinstance(cfg.strategy, PSStrategy):
        raise ValueError(f"fleetwise.runtime.ps runs strategy=ps, got strategy={cfg.strategy.name}")
    if not isinstance(cfg.model, CTRModel):
        raise NotImplementedError(
            f"the parameter-server runtime trains CTR models (sparse tables on the servers); "
            f"model family '{cfg.model.family}' is planned only: use a collective strategy to train it"
        )
    role = role_from_env(cfg)
    run_dir = Path(run_dir)
    # Several processes share the host's cores; one intra-op pool each would oversubscribe them.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", role.world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    log(role, f"rank {role.rank} of {role.world_size}, pid {os.getpid()}")
    try:
        if role.is_trainer:
            from fleetwise.runtime.ps.trainer import train

            train(cfg, role, run_dir)
        else:
            from fleetwise.runtime.ps.server import serve

            serve(cfg, role, run_dir)
    except BaseException:
        log(role, "failed:\n" + traceback.format_exc())
        with contextlib.suppress(Exception):  # RPC may not have started
            rpc.shutdown(graceful=False)  # do not wait for peers that may be gone
        raise
    log(role, "finished")


__all__ = ["run"]
