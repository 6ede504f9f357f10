"""Parameter-server training (`strategy=ps`) on torch.distributed.rpc (TensorPipe), after
PaddlePaddle Fluid's pserver mode (parameter shards on servers; trainers push gradients and pull
values; distributed sparse embeddings; RoundRobin / HashName dispatch; slice_var_up).

Entry contract, for the launcher (`fleetwise train strategy=ps`, through the same worker entry
point as every collective job, runtime/worker.py):
- Launch `world_size(cfg)` = num_trainers + num_servers processes (one node: torchrun
  --nproc-per-node that many) and call `run(cfg, plan, run_dir)` once in each, after torchrun has set
  RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. `cfg` is the resolved,
  validated RunConfig (the one in run_dir/config.yaml); validate with launching=True, which
  refuses ps jobs this runtime cannot train (non-CTR models, CUDA hardware).
- Roles (roles.py): ranks 0..T-1 are trainers 0..T-1, ranks T..T+S-1 servers 0..S-1. Global
  rank 0 is trainer 0, the only writer of run_dir/metrics.jsonl (one line per step) and
  run_dir/ps_summary.json (per-trainer and per-server totals, written at the end).
- `run` returns normally in every process once training is done and the servers have shut down;
  it raises on failure (the process then exits non-zero and torchrun stops the others with
  SIGTERM). The caller (the worker) redirects stdout/stderr to run_dir/logs/rank_<RANK>.log.
- With `checkpoint.enabled=true` each server writes its shard to run_dir/ps/server_<i>.pt when
  training ends, and also when torchrun stops it with SIGTERM: the last consistent state (in sync
  mode a trainer that dies mid-step leaves no half-applied update). `reference.load_shards`
  reassembles the full model from them.

Why TensorPipe RPC: it is the request/response engine that ships with PyTorch (the design's engine
choice for the parameter server). c10d point-to-point (send/recv) would need every pull and push
matched by a receive posted in advance on the server, the opposite of a server that answers
whichever trainer asks, and gloo collectives would put every trainer in lockstep (no async mode).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from pathlib import Path

from fleetwise.config.run import RunConfig
from fleetwise.plan.records import Plan


def world_size(cfg: RunConfig) -> int:
    """Processes a parameter-server job needs: trainers + servers."""
    from fleetwise.config.strategy import PSStrategy

    assert isinstance(cfg.strategy, PSStrategy)
    return cfg.strategy.num_trainers + cfg.strategy.num_servers


def run(cfg: RunConfig, plan: Plan, run_dir: Path) -> None:
    """Run this process's role (trainer or server) of a parameter-server job."""
    import torch
    import torch.distributed.rpc as rpc

    from fleetwise.config.strategy import PSStrategy
    from fleetwise.families import family_of
    from fleetwise.runtime.ps.roles import log, role_from_env

    if not isinstance(cfg.strategy, PSStrategy):
        raise ValueError(f"fleetwise.runtime.ps runs strategy=ps, got strategy={cfg.strategy.name}")
    if family_of(cfg.model).sparse_tables is None:
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

            train(cfg, plan, role, run_dir)
        else:
            from fleetwise.runtime.ps.server import serve

            serve(cfg, role, run_dir)
    except BaseException:
        log(role, "failed:\n" + traceback.format_exc())
        with contextlib.suppress(Exception):  # RPC may not have started
            rpc.shutdown(graceful=False)  # do not wait for peers that may be gone
        raise
    log(role, "finished")


__all__ = ["run", "world_size"]
