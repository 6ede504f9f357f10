"""Optimizers of the parameter server: torch.optim itself, applied to server shards.

Dense variables use `cfg.optim` (SGD, AdamW, Adagrad). These optimizers are element-wise, so
running them on row blocks of a variable spread over servers gives exactly what one optimizer on
the whole variable gives; that is why sync training can equal single-process training.

Distributed sparse tables use `strategy.sparse_optimizer` (SGD or Adagrad at `optim.lr`, Adagrad's
epsilon `optim.eps`, no weight decay or momentum) through torch's own sparse-gradient path: a row
that no trainer touched keeps its value and its Adagrad accumulator, which is also what the dense
optimizer does to an all-zero gradient row, so a single-process run with dense embedding
gradients is the reference.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fleetwise.config.optim import OptimConfig
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import PSStrategy
from fleetwise.runtime.optim import lr_factor


def lr_at(cfg: RunConfig, step: int) -> float:
    """Learning rate of optimizer step `step` (from 0): the collective runtime's schedule, so a
    job logs the same train/lr curve under every strategy."""
    return cfg.optim.lr * lr_factor(step, cfg.optim, cfg.train)


def dense_optimizer(params: Iterable[torch.Tensor], o: OptimConfig) -> torch.optim.Optimizer:
    # foreach=False everywhere: servers and the single-process reference run the same kernels
    params = list(params)
    if o.name == "sgd":
        return torch.optim.SGD(
            params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, foreach=False
        )
    if o.name == "adagrad":
        return torch.optim.Adagrad(params, lr=o.lr, eps=o.eps, weight_decay=o.weight_decay, foreach=False)
    return torch.optim.AdamW(
        params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=False
    )


def sparse_optimizer(params: Iterable[torch.Tensor], s: PSStrategy, o: OptimConfig) -> torch.optim.Optimizer:
    params = list(params)
    if s.sparse_optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=o.lr, eps=o.eps, foreach=False)
    return torch.optim.SGD(params, lr=o.lr, foreach=False)


def set_lr(opt: torch.optim.Optimizer | None, lr: float) -> None:
    if opt is not None:
        for group in opt.param_groups:
            group["lr"] = lr


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
