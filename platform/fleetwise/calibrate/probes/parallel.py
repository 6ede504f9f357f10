"""What a parallel engine adds over the same plain module, on a 2-rank mesh: DTensor tensor
parallel per op, FSDP2 per unit pass and tensor and its buffer copies per element, ZeRO-1's hooks
and per-step bookkeeping. Each times the engine against its plain twin, interleaved."""

from __future__ import annotations

import torch

from fleetwise.calibrate.probes.timing import interleaved
from fleetwise.calibrate.probes.workloads import Chain, OpCounter


def dtensor_op_us(mesh, latency_s: float, layers: int = 8, width: int = 16, reps: int = 30) -> float:
    """Extra host time per forward op of a tensor-parallel (DTensor) module over the same plain one,
    forward + backward, after its collectives' latency is taken out: sharding propagation, the
    subclass dispatch and waiting for the peer. Run on every rank of a 2-rank `mesh`."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    plain, tp = Chain(layers, width), Chain(layers, width)
    plan = {f"layers.{i}.fc1": ColwiseParallel() for i in range(layers)}
    plan |= {f"layers.{i}.fc2": RowwiseParallel() for i in range(layers)}
    parallelize_module(tp, mesh, plan)
    x = torch.randn(2, 8, width)
    with torch.no_grad(), OpCounter() as counter:
        plain(x)
    t_plain, t_tp = interleaved([lambda: plain(x).backward(), lambda: tp(x).backward()], reps)
    collectives = 2 * layers  # row-parallel output (forward), column-parallel input grad (backward)
    return max(0.0, t_tp - t_plain - collectives * latency_s) / counter.count * 1e6


def fsdp_twins(mesh, layers: int, width: int) -> tuple[Chain, Chain]:
    """A plain chain and its twin with every block (and the root) fully sharded over `mesh`, kept
    gathered until the backward (ZeRO-2), as the FSDP probes compare them."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    plain, sharded = Chain(layers, width), Chain(layers, width)
    for block in sharded.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(sharded, mesh=mesh, reshard_after_forward=False)
    return plain, sharded


def fsdp_us_per_tensor(mesh, latency_s: float, layers: int = 8, width: int = 16, reps: int = 30) -> float:
    """Extra host time of FSDP2 per unit and parameter tensor in one forward + backward, over the
    same plain module and after its collectives' latency is taken out: the hooks, the copies into
    and out of the flat all-gather and reduce-scatter buffers (per tensor) and waiting for the peer.
    It is paid for every unit in every micro-batch (the hooks run whether or not they gather), so
    the planner charges it per unit pass, not per collective."""
    plain, sharded = fsdp_twins(mesh, layers, width)
    x = torch.randn(2, 8, width)
    t_plain, t_sharded = interleaved([lambda: plain(x).backward(), lambda: sharded(x).backward()], reps)
    collectives = 2 * layers  # an all-gather and a reduce-scatter per block (the root holds none)
    tensors = sum(1 for _ in sharded.layers["0"].parameters())
    return max(0.0, t_sharded - t_plain - collectives * latency_s) / layers / tensors * 1e6


def fsdp_ns_per_param(mesh, per_tensor_us: float, layers: int = 2, width: int = 2048, reps: int = 8) -> float:
    """FSDP2's extra time per parameter element of a unit and per all-gather or reduce-scatter of it:
    the copies into and out of its flat collective buffers, which `fsdp_us_per_tensor`'s width-16
    blocks leave out. Wide blocks, fully sharded and plain, and the same collectives run alone:
    what FSDP adds beyond those collectives and its per-tensor host work is memory-bound copying.
    Units of 8.4M parameters, beyond the caches like a real model's (at width 1024, 2.1M, the copies
    read 0.8-1.8 ns, at 2048 2.3-3.5 on 2 CPU ranks: ~110 ms a micro-batch for a 19M GPT). Run on
    every rank of `mesh`, which co-run."""
    import torch.distributed as dist

    plain, sharded = fsdp_twins(mesh, layers, width)
    x = torch.randn(2, 8, width)
    params = [p.numel() for p in plain.layers["0"].parameters()]
    world = mesh.size()
    piece = torch.zeros(-(-sum(params) // world))  # FSDP pads each unit's flat buffer to the world size
    whole = torch.zeros(piece.numel() * world)
    group = mesh.get_group()

    def collectives() -> None:  # each unit's all-gather (forward) and reduce-scatter (backward)
        for _ in range(layers):
            dist.all_gather_into_tensor(whole, piece, group=group)
            dist.reduce_scatter_tensor(piece, whole, group=group)

    t_plain, t_sharded, t_comm = interleaved(
        [lambda: plain(x).backward(), lambda: sharded(x).backward(), collectives], reps
    )
    hooks = layers * len(params) * per_tensor_us * 1e-6
    return max(0.0, t_sharded - t_plain - t_comm - hooks) / (2 * layers * sum(params)) * 1e9


def zero1_host_us(
    mesh, latency_s: float, layers: int = 8, width: int = 16, reps: int = 20
) -> tuple[float, float]:
    """(per parameter tensor and micro-batch, per parameter tensor and step): extra host time of
    the ZeRO-1 engine (runtime/zero1.py) over the same plain module and update, after its three
    collectives' latency (gradients, the norm, the weights) is taken out. Per
    micro-batch: its gradient hook (a Python call adding the fresh gradient into the fp32 buffer);
    per step: the reduce's bookkeeping, the pieces' squared norms and the all-gather's copies in
    and out. Steps of 1 and 3 micro-batches tell the two apart. Run on every rank of `mesh`
    (dims dp, sharding, mp: sharding over all ranks); the ranks co-run, like FSDP's probe."""
    import torch.distributed as dist

    from fleetwise.config.optim import OptimConfig
    from fleetwise.config.run import TrainConfig
    from fleetwise.runtime.optim import Optimizers, Zero1Optimizers

    torch.manual_seed(0)
    optim, train = OptimConfig(lr=1e-3), TrainConfig(global_batch_size=1, micro_batch_size=1, steps=reps)
    plain, sharded = Chain(layers, width), Chain(layers, width)
    params = list(plain.parameters())
    gloo = dist.get_backend(mesh["sharding"].get_group()) == "gloo"
    # the trainer's own update path for each engine (Trainer.train_step: reduce, norm, clip, step)
    engines = (
        Optimizers([plain], optim, train),
        Zero1Optimizers([sharded], optim, train, mesh, all_reduce=gloo),
    )
    x = torch.randn(2, 8, width)

    def step(engine: Optimizers, module: torch.nn.Module, n: int) -> None:
        for _ in range(n):
            module(x).backward()
        engine.reduce_grads()
        own = [p for _, p in engine.named_params()]
        engine.clip_(own, 1.0, engine.grad_norm(own, mesh, None, x.device))
        engine.step()
        engine.zero_grad()

    p1, z1, p3, z3 = interleaved(
        [
            lambda e=e, m=m, n=n: step(e, m, n)
            for n in (1, 3)
            for e, m in zip(engines, (plain, sharded), strict=True)
        ],
        reps,
    )
    tensors = len(params)
    per_micro = max(0.0, ((z3 - p3) - (z1 - p1)) / 2 / tensors)
    per_step = max(0.0, (z1 - p1 - 3 * latency_s) / tensors - per_micro)
    return per_micro * 1e6, per_step * 1e6
