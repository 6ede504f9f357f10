"""What sync parameter-server training must equal, written here without the product's training code.

`fleetwise.runtime.ps.reference.train_single_process` shares the ps trainer's optimizer builders
and its learning-rate schedule (`lr_at`), so a bug in either hits both sides alike (measured: a
constant LR factor passed the ps parity tests). This loop shares only the model (CTRNet: its
architecture and seeded initial weights) and the samples (SyntheticClicks at the step's indices):
torch.optim built here from the config's numbers, the schedule in closed form, torch's own
`clip_grad_norm_` over every parameter, and the whole global batch in one forward (the trainers
split it into micro-batches of equal size, so the mean loss is the same).

The documented ps semantics it writes down: dense variables (non-distributed tables included) use
`optim` with weight decay on every dense variable; distributed tables use
`strategy.sparse_optimizer` (SGD or Adagrad at the same LR, no weight decay or momentum); the LR
warms up linearly over `warmup_steps`, then stays (constant) or follows a cosine to
`min_lr_ratio · lr` at the last step.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def lr_closed_form(o, steps: int, k: int) -> float:
    """LR of optimizer step k (from 0)."""
    if k < o.warmup_steps:
        return o.lr * (k + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    progress = min(1.0, (k - o.warmup_steps) / max(1, steps - o.warmup_steps))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def plain_ps_loop(cfg, steps: int):
    """Returns (model after `steps` steps, losses, pre-clip global gradient norms, LRs)."""
    from fleetwise.families.ctr.data import SyntheticClicks
    from fleetwise.families.ctr.model import CTRNet

    o, s, m = cfg.optim, cfg.strategy, cfg.model
    model = CTRNet(m, seed=cfg.train.seed)
    data = SyntheticClicks(m, cfg.data)
    remote_names = {
        f"{kind}.{t.name}.weight"
        for t in m.sparse_tables
        if t.distributed
        for kind in ("embeddings", "first_order")
    }
    named = dict(model.named_parameters())
    dense = [p for n, p in named.items() if n not in remote_names]
    remote = [p for n, p in named.items() if n in remote_names]
    if o.name == "sgd":
        dense_opt = torch.optim.SGD(dense, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    elif o.name == "adagrad":
        dense_opt = torch.optim.Adagrad(dense, lr=o.lr, eps=o.eps, weight_decay=o.weight_decay)
    else:
        dense_opt = torch.optim.AdamW(
            dense, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
        )
    opts = [dense_opt]
    if remote:
        sparse = torch.optim.Adagrad if s.sparse_optimizer == "adagrad" else torch.optim.SGD
        opts.append(sparse(remote, lr=o.lr, **({"eps": o.eps} if s.sparse_optimizer == "adagrad" else {})))
    n = cfg.train.global_batch_size
    losses, norms, lrs = [], [], []
    for k in range(steps):
        batch = data.batch(np.arange(k * n, (k + 1) * n) % cfg.data.num_samples)
        loss = F.binary_cross_entropy_with_logits(model(batch["sparse_ids"], batch["dense"]), batch["labels"])
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        max_norm = o.grad_clip if o.grad_clip is not None else math.inf
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        lr = lr_closed_form(o, cfg.train.steps, k)
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
        losses.append(float(loss.detach()))
        lrs.append(lr)
    return model, losses, norms, lrs
