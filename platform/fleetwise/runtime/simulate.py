"""Fake execution: run the real per-rank runtime (mesh, parallelize, optimizer, train step) of one
rank of a job of any size, without the memory, the compute or the other ranks.

The pieces, usable on their own (a test mode can take any of them):

- `init_fake_world(rank, world_size)`: the `fake` process-group backend (torch's FakeProcessGroup):
  every collective "succeeds" at once, moving nothing; the DeviceMesh and its subgroups are real.
- `FakeExecution`: a context holding a `FakeTensorMode` (tensors with shapes, dtypes and storages
  but no data) and `HostReads`, which answers host reads of a device scalar (`.item()`,
  `float(t)`, `bool(t)` = `aten._local_scalar_dense`, refused by fake tensors) with a placeholder:
  1 -- a finite flag is "finite", a vote is "yes" (torch.distributed.pipelining's P2P warm-up vote
  then picks static shapes, which is what the fake backend can serve).
  `FakeExecution.allocate` is the `allocate` hook of `runtime.parallelize.parallelize`: a meta-built
  part gets fake storage instead of real memory and initial values.
- `CollectiveBytes`: a dispatch mode counting the bytes each collective moves, by mesh dimension.
- `simulate_rank(cfg, plan, rank, steps)`: all of the above around the unchanged `Trainer`, with
  FLOPs from torch's `FlopCounterMode` and the live-tensor peak from the same tracker the real run
  uses (`runtime.memory.LiveTensorBytes`, through `Trainer.memory`); returns a JSON-able report.

Traps (torch 2.13, CPU build): DeviceMesh creation and `parallelize_module` / `fully_shard` must run
outside `FakeTensorMode` (mesh coordinates call `nonzero`); only allocation and the steps run inside.
Fake `cuda` tensors cannot be created on a CPU build, so a GPU job is simulated on the cpu device:
bytes are the tensors' own, without the CUDA caching allocator's rounding.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_aten = torch.ops.aten


def init_fake_world(rank: int, world_size: int) -> None:
    """Join a fake process group of `world_size` ranks as `rank` (no other process needed)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


class HostReads(TorchDispatchMode):
    """Answers `aten._local_scalar_dense` (a host read of a device scalar) with `value` for every
    tensor (fake or not); everything else passes through. Counts the reads it answered."""

    def __init__(self, value: float = 1):
        super().__init__()
        self.value = value
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _aten._local_scalar_dense.default:
            self.reads += 1
            dtype = args[0].dtype
            if dtype == torch.bool:
                return bool(self.value)
            return float(self.value) if dtype.is_floating_point else int(self.value)
        return func(*args, **(kwargs or {}))


class FakeExecution:
    """`with FakeExecution() as fx:` -- tensors created or computed inside are fake; host reads of
    scalars are answered by `HostReads`. Re-enterable (allocation, then each step)."""

    def __init__(self, scalar: float = 1):
        from torch._subclasses.fake_tensor import FakeTensorMode

        # allow_non_fake_inputs: real host tensors (data batches, constants) mix with fake ones
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.host_reads = HostReads(scalar)
        self._stack: list[contextlib.ExitStack] = []

    def __enter__(self) -> FakeExecution:
        stack = contextlib.ExitStack()
        stack.enter_context(self.mode)
        stack.enter_context(self.host_reads)
        self._stack.append(stack)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.pop().close()

    def allocate(self, device: torch.device):
        """The `allocate` hook of `parallelize`: fake storage for this rank's shards, no values."""

        def allocate(part: nn.Module) -> None:
            with self:
                part.to_empty(device=device)

        return allocate


_COLLECTIVES = {
    # c10d ops (process-group API): the tensor argument(s) whose bytes this rank sends
    "allreduce_",
    "allgather_",
    "_allgather_base_",
    "allgather_into_tensor_coalesced_",
    "reduce_scatter_",
    "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_",
    "broadcast_",
    "reduce_",
    "gather_",
    "scatter_",
    "alltoall_",
    "alltoall_base_",
    "send",
    "recv_",
    "allreduce_coalesced_",
    # functional collectives (DTensor)
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
    "broadcast",
}


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))


class CollectiveBytes(TorchDispatchMode):
    """Bytes of this rank's collectives, by (group label, op): the size of the tensor a rank
    contributes (all-reduce, reduce-scatter input, all-gather shard, send/recv buffer). Groups are
    named by `labels` (process-group name -> label, e.g. a mesh dimension); others by size."""

    def __init__(self, labels: dict[str, str]):
        super().__init__()
        self.labels = labels
        self.bytes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.calls: dict[str, int] = defaultdict(int)

    def _group(self, args) -> str:
        for a in args:
            if isinstance(a, str) and a in self.labels:
                return self.labels[a]
            name = getattr(a, "group_name", None)
            if isinstance(name, str):
                return self.labels.get(name, name)
        return "?"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = func.namespace
        op = func._schema.name.split("::")[-1]
        if ns in ("c10d", "_c10d_functional") and op in _COLLECTIVES:
            first = args[0]
            if op in ("allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_", "recv_"):
                sent = args[1] if op != "recv_" else first  # the input shard(s)
            elif op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
                sent = first
            else:
                sent = first
            self.bytes[self._group(args)][op.rstrip("_")] += _nbytes(sent)
            self.calls[op.rstrip("_")] += 1
        return func(*args, **(kwargs or {}))


def mesh_group_labels(mesh) -> dict[str, str]:
    """Process-group name -> mesh dimension, for every dimension (and flattened pairs) of `mesh`."""
    out = {}
    for dim in mesh.mesh_dim_names:
        with contextlib.suppress(Exception):
            out[mesh[dim].get_group().group_name] = dim
    from fleetwise.runtime.parallelize import _FLAT

    for dims, group in _FLAT.items():
        out[group.group_name] = "+".join(dims)
    return out


def state_bytes(trainer) -> dict[str, int]:
    """Bytes of what outlives a step on this rank, by category (DTensors by their local shard)."""
    from fleetwise.runtime.trainer import _local

    def size(t) -> int:
        t = _local(t)
        return t.untyped_storage().nbytes() if t.numel() else 0

    seen: set[int] = set()

    def total(tensors) -> int:
        n = 0
        for t in tensors:
            key = _local(t).untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                n += size(t)
        return n

    params = list(trainer.model.parameters())
    out = {"params": total(params), "grads": total(p.grad for p in params if p.grad is not None)}
    out["optimizer"] = total(
        v for opt in trainer.optimizers.local() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
    )
    out["buffers"] = total(b for part in trainer.model.parts for b in part.buffers())
    return out


def simulate_rank(cfg, plan: dict[str, Any], rank: int, steps: int = 2, run_dir=None) -> dict[str, Any]:
    """Run `steps` optimizer steps of rank `rank` of the job `cfg` (any world size) under fake
    tensors and the fake backend, in this process, with the real Trainer. Returns the report."""
    import tempfile
    from pathlib import Path

    from torch.utils.flop_counter import FlopCounterMode

    from fleetwise.runtime.mesh import DistEnv
    from fleetwise.runtime.trainer import Trainer

    started = time.perf_counter()
    world = cfg.hardware.world_size
    init_fake_world(rank, world)
    device = torch.device("cpu")  # fake cuda needs a CUDA build of torch: see the module's note
    env = DistEnv(rank, world, 0, device, 0)
    fx = FakeExecution()
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="fleetwise-dryrun-"))
    trainer = Trainer(cfg, plan, env, run_dir, allocate=fx.allocate(device))
    trainer.memory.samples = steps  # the live-tensor tracker of the real run, on every simulated step
    built = time.perf_counter()
    labels = mesh_group_labels(trainer.mesh)
    for step in range(1, steps + 1):  # the last step is reported (the first has no optimizer state yet)
        comm, flops = CollectiveBytes(labels), FlopCounterMode(display=False)
        with fx, flops, comm:
            trainer.train_step(step)
    state = state_bytes(trainer)
    peak = trainer.memory.peak
    state_total = sum(state.values())
    return {
        "rank": rank,
        "coords": trainer.coords,
        "chunks": trainer.model.chunk_ids,
        "memory_bytes": {**state, "activations_and_temporaries": max(peak - state_total, 0), "peak": peak},
        "flops_per_step": flops.get_total_flops(),
        "comm_bytes_per_step": {g: dict(v) for g, v in comm.bytes.items()},
        "host_reads": fx.host_reads.reads,
        "time_s": {"build": built - started, "steps": time.perf_counter() - built},
        "pid": os.getpid(),
    }
