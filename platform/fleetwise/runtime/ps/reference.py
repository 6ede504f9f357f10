"""What sync parameter-server training must equal, and how to read the servers' shards back.

`train_single_process` is a plain PyTorch loop over `CTRNet` on the same global batches with the
same optimizers: `cfg.optim` for dense parameters (non-distributed tables included) and
`strategy.sparse_optimizer` for the distributed tables, the learning-rate schedule of
`optim.lr_at` (the collective runtime's), and global-norm clipping over all parameters. Sync PS training with any number of
servers and trainers, either dispatch method and any slicing must end at the same parameters up to
float rounding (gradients are summed in a different order).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import PSStrategy
from fleetwise.families.ctr.data import SyntheticClicks, step_indices
from fleetwise.families.ctr.model import CTRNet, ctr_loss
from fleetwise.families.ctr.schema import CTRModel
from fleetwise.plan.ps import placement, table_parameter_names
from fleetwise.runtime.ps.optim import dense_optimizer, lr_at, set_lr, sparse_optimizer


def train_single_process(cfg: RunConfig, steps: int | None = None) -> tuple[CTRNet, list[float]]:
    s, m = cfg.strategy, cfg.model
    assert isinstance(s, PSStrategy) and isinstance(m, CTRModel)
    model = CTRNet(m, seed=cfg.train.seed)
    data = SyntheticClicks(m, cfg.data)
    remote = {n for t in m.sparse_tables if t.distributed for n in table_parameter_names(t.name)}
    named = dict(model.named_parameters())
    dense_opt = dense_optimizer([p for n, p in named.items() if n not in remote], cfg.optim)
    tables = [p for n, p in named.items() if n in remote]
    sparse_opt = sparse_optimizer(tables, s, cfg.optim) if tables else None
    losses = []
    for k in range(cfg.train.steps if steps is None else steps):
        batch = data.batch(step_indices(k, cfg.train.global_batch_size, cfg.data.num_samples))
        loss = ctr_loss(model(batch["sparse_ids"], batch["dense"]), batch["labels"])
        model.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.optim.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, foreach=False)
        lr = lr_at(cfg, k)
        for opt in (dense_opt, sparse_opt):
            set_lr(opt, lr)
            if opt is not None:
                opt.step()
        losses.append(float(loss.detach()))
    return model, losses


def load_shards(cfg: RunConfig, run_dir: Path) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Reassemble the full model state from `run_dir/ps/server_<i>.pt` (written with
    checkpoint.enabled=true). Returns (state dict by CTRNet parameter name, the raw shards)."""
    s, m = cfg.strategy, cfg.model
    assert isinstance(s, PSStrategy) and isinstance(m, CTRModel)
    shards = [torch.load(run_dir / "ps" / f"server_{i}.pt", weights_only=False) for i in range(s.num_servers)]
    place = placement(cfg)
    blocks = {k: v for sh in shards for k, v in sh["blocks"].items()}
    state: dict[str, torch.Tensor] = {}
    for name in place.dense_names:
        parts = sorted((b for b in place.dense if b.name == name), key=lambda b: b.index)
        state[name] = torch.cat([blocks[b.key] for b in parts])
    for t in place.tables:
        full = torch.empty(t.num_rows, t.width)
        for sh in shards:
            part = sh["tables"][t.name]
            full[part["ids"]] = part["values"]
        emb, first = table_parameter_names(t.name)
        state[emb], state[first] = full[:, :-1].contiguous(), full[:, -1:].contiguous()
    return state, shards
