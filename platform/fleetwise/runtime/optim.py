"""Optimizer, learning-rate schedule, and a gradient norm that is right for any layout."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fleetwise.config.run import OptimConfig, TrainConfig
from fleetwise.runtime.zero1 import Zero1


def build_optimizer(params: list[nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """Weight decay applies to matrices (ndim >= 2), not to biases and norms (as in GPT-2/nanoGPT)."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    if cfg.name == "adamw":
        cls, kwargs = torch.optim.AdamW, {"betas": cfg.betas, "eps": cfg.eps}
    elif cfg.name == "sgd":
        cls, kwargs = torch.optim.SGD, {"momentum": cfg.momentum}
    else:
        cls, kwargs = torch.optim.Adagrad, {"eps": cfg.eps}
    groups = [
        g
        for g in (
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        )
        if g["params"]
    ]
    return cls(groups, lr=cfg.lr, **kwargs)


def lr_factor(done: int, optim: OptimConfig, train: TrainConfig) -> float:
    """LR multiplier after `done` completed steps: linear warm-up, then constant or cosine decay to
    min_lr_ratio at the last step."""
    if done < optim.warmup_steps:
        return (done + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    progress = (done - optim.warmup_steps) / max(1, train.steps - optim.warmup_steps)
    progress = min(1.0, progress)
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, train: TrainConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: lr_factor(done, optim, train))


class Optimizers:
    """One optimizer and LR scheduler per model part (pipeline chunk), stepped together -- as
    torchtitan does: torch.distributed.checkpoint's optimizer state dicts are per module and keyed
    by parameter name, so each part saves and loads its own share and a checkpoint reshards across
    pipeline layouts.

    zero_mesh: ZeRO-1 (runtime/zero1.py): each part's optimizer is a `Zero1`, whose inner torch
    optimizer steps fp32 master chunks; built at the first step (`build`), so that the dry run
    allocates its buffers as fake tensors."""

    def __init__(
        self,
        parts: list[nn.Module],
        optim: OptimConfig,
        train: TrainConfig,
        *,
        zero_mesh=None,
        working_dtype: torch.dtype = torch.float32,
        grad_divisor: int = 1,
    ):
        self.parts, self.optim, self.train = parts, optim, train
        self.zero: list[Zero1] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._schedulers: list = []
        if zero_mesh is not None:
            self.zero = [
                Zero1(
                    part,
                    optim,
                    zero_mesh,
                    working_dtype=working_dtype,
                    grad_divisor=grad_divisor,
                    build_optimizer=build_optimizer,
                )
                for part in parts
            ]
        else:
            self.build()

    def build(self) -> None:
        if self._optimizers:
            return
        if self.zero:
            self._optimizers = [z.build() for z in self.zero]
        else:
            self._optimizers = [
                build_optimizer([p for p in part.parameters() if p.requires_grad], self.optim)
                for part in self.parts
            ]
        self._schedulers = [build_scheduler(o, self.optim, self.train) for o in self._optimizers]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        self.build()
        return self._optimizers

    @property
    def schedulers(self) -> list:
        self.build()
        return self._schedulers

    @property
    def lr(self) -> float:
        return self.optimizers[0].param_groups[0]["lr"]

    def step(self, scaler=None) -> None:
        for opt, sched in zip(self.optimizers, self.schedulers, strict=True):
            if scaler is not None:
                scaler.step(opt)
            else:
                opt.step()
            sched.step()
        for z in self.zero:  # the updated masters back into every rank's working weights
            z.gather()

    def skip(self) -> None:
        """A skipped step still advances the schedule (the step number is what it follows)."""
        for sched in self.schedulers:
            sched.step()

    def restore_schedule(self, done: int) -> None:
        """Put the LR schedules where they were after `done` steps (resume from a checkpoint)."""
        for opt, sched in zip(self.optimizers, self.schedulers, strict=True):
            sched.last_epoch = done
            for group, base in zip(opt.param_groups, sched.base_lrs, strict=True):
                group["lr"] = base * sched.lr_lambdas[0](done)
            sched._last_lr = [g["lr"] for g in opt.param_groups]

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        for z in self.zero:
            z.zero_grad()

    def local(self) -> list[torch.optim.Optimizer]:
        """The optimizers that hold state on this rank."""
        return self.optimizers

    # --- ZeRO-1: the gradients live in the engine's buffers, not in the parameters' .grad -------
    def reduce_grads(self) -> None:
        for z in self.zero:
            z.reduce()

    def zero_grad_norm(self, mesh, pp_group, device: torch.device) -> torch.Tensor:
        """Global L2 norm of the reduced gradient chunks: summed over `sharding` (disjoint chunks),
        over `mp` for the chunks of tensor-parallel shards (not for replicated weights, which every
        mp rank holds the same), over `pp` (disjoint stages); never over `dp` (replicas)."""
        sq = torch.stack([z.squared_norms() for z in self.zero]).sum(0).to(device)
        if mesh["sharding"].size() > 1:
            dist.all_reduce(sq, group=mesh["sharding"].get_group())
        replicated, sharded = sq[0], sq[1:2].clone()
        if mesh["mp"].size() > 1:
            dist.all_reduce(sharded, group=mesh["mp"].get_group())
        total_sq = (replicated + sharded[0]).reshape(())
        if pp_group is not None and dist.get_world_size(pp_group) > 1:
            dist.all_reduce(total_sq, group=pp_group)
        return total_sq.sqrt()

    def zero_clip_(self, max_norm: float, total: torch.Tensor) -> None:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for z in self.zero:
            z.clip_(coef)


def grad_norm(params: list[nn.Parameter], pp_group=None, device: torch.device | None = None) -> torch.Tensor:
    """Global L2 norm of all gradients of the job.

    Gradients are grouped by their DTensor layout (mesh and placements: FSDP shards, TP shards,
    replicas); DTensor computes each group's norm with the right reduction (a sharded dim is
    summed, a replicated one is not). Plain tensors are whole on every rank that holds them.
    Pipeline stages own disjoint parameters, so their squared norms are summed across pp.

    The result lives on `device` (the job's device), where the pipeline reduction and the
    trainer's finite-flag all-reduce need it: offloaded gradients are on the host."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else "local"
        groups[key].append(g)
    device = device or next((p.device for p in params), torch.device("cpu"))
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    # a fixed group order, so every rank of a DTensor mesh calls its collectives in the same order
    for key in sorted(groups, key=str):
        norm = torch.nn.utils.get_total_norm(groups[key], norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq += norm.float().to(device) ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


def clip_(params: list[nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    """Scale gradients to a global norm of at most max_norm, given the norm `grad_norm` computed.

    One foreach multiply per group of gradients that share a device, dtype and DTensor mesh (a
    foreach op cannot mix meshes: TP and FSDP gradients of a hybrid job live on different ones),
    instead of a kernel launch per parameter; the factor stays on the device (no host sync, as in
    torch.nn.utils.clip_grads_with_norm_, which refuses such mixed DTensor lists)."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            g = p.grad
            mesh = g.device_mesh if isinstance(g, DTensor) else None
            groups[(mesh, g.device, g.dtype)].append(g)
    for (_, device, dtype), grads in groups.items():
        torch._foreach_mul_(grads, coef.to(device=device, dtype=dtype))
