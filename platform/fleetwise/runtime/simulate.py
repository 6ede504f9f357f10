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
    """Answers `aten._local_scalar_dense` (a host read of a device scalar, refused by fake tensors)
    with a placeholder; everything else passes through. Floating and bool scalars read 1 / True (a
    finite flag is finite, a loss or norm is 1.0); integers read 0 -- the one integer read in the
    runtime is torch.distributed.pipelining's warm-up vote, where 0 means "some stage has no static
    shapes", which is true of fleetwise's stages, so the schedule takes the same dynamic-shape path
    as the real run (its metadata goes through `MetaRelay`). Counts the reads it answered."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _aten._local_scalar_dense.default:
            self.reads += 1
            dtype = args[0].dtype
            if dtype == torch.bool:
                return True
            return 1.0 if dtype.is_floating_point or dtype.is_complex else 0
        return func(*args, **(kwargs or {}))


class MetaRelay:
    """Carries torch.distributed.pipelining's stage metadata (the pickled shapes a stage sends its
    neighbour with send_object_list before the first step) between simulated ranks, through files
    in `folder`: the fake backend moves no data, and a stage cannot infer its input shapes without
    its neighbour's. Every stage of one pipeline must therefore be simulated at the same time."""

    def __init__(self, folder, timeout_s: float = 1800.0):
        from pathlib import Path

        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.sent: dict[tuple[int, int], int] = defaultdict(int)
        self.received: dict[tuple[int, int], int] = defaultdict(int)

    def _path(self, src: int, dst: int, seq: int):
        return self.folder / f"stage{src}_to_{dst}_{seq}.pkl"

    def put(self, src: int, dst: int, meta) -> None:
        import pickle

        seq = self.sent[src, dst]
        self.sent[src, dst] += 1
        tmp = self._path(src, dst, seq).with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(pickle.dumps(meta))
        os.replace(tmp, self._path(src, dst, seq))

    def get(self, src: int, dst: int):
        import pickle

        seq = self.received[src, dst]
        self.received[src, dst] += 1
        path, waited = self._path(src, dst, seq), 0.0
        while not path.exists():
            if waited > self.timeout_s:
                raise TimeoutError(
                    f"pipeline stage {src} never sent its metadata to stage {dst} ({path}): "
                    "simulate every stage of one pipeline together"
                )
            time.sleep(0.05)
            waited += 0.05
        return pickle.loads(path.read_bytes())

    def install(self) -> None:
        """Route PipelineStage's metadata exchange (this process only) through the relay."""
        from torch.distributed.pipelining.stage import PipelineStage

        relay = self

        def send_meta(stage, meta, dst_stage: int) -> None:
            relay.put(stage.stage_index, dst_stage, meta)

        def recv_meta(stage, src_stage: int):
            return relay.get(src_stage, stage.stage_index)

        PipelineStage._send_meta = send_meta
        PipelineStage._recv_meta = recv_meta


class FakeExecution:
    """`with FakeExecution() as fx:` -- tensors created or computed inside are fake; host reads of
    scalars are answered by `HostReads`. Re-enterable (allocation, then each step)."""

    def __init__(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        # allow_non_fake_inputs: real host tensors (data batches, constants) mix with fake ones
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.host_reads = HostReads()
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


# op -> (index of the argument this rank contributes, ring factor): the bytes a rank *sends* with
# ring algorithms, the planner's convention -- all-reduce 2(n-1)/n of the tensor, all-gather (n-1)
# times its shard, reduce-scatter (n-1)/n of its input, broadcast (n-1)/n, send all of it.
_ALL_REDUCE = (0, lambda n: 2 * (n - 1) / n)
_GATHER = (1, lambda n: n - 1)  # argument 1: the input shard
_SCATTER = (1, lambda n: (n - 1) / n)  # argument 1: the full input
_COLLECTIVES = {
    # c10d ops (the process-group API: FSDP, DDP, pipelining, the trainer's metrics)
    "allreduce_": _ALL_REDUCE,
    "allreduce_coalesced_": _ALL_REDUCE,
    "allgather_": _GATHER,
    "_allgather_base_": _GATHER,
    "allgather_into_tensor_coalesced_": _GATHER,
    "reduce_scatter_": _SCATTER,
    "_reduce_scatter_base_": _SCATTER,
    "reduce_scatter_tensor_coalesced_": _SCATTER,
    "broadcast_": (0, lambda n: (n - 1) / n),
    "gather_": (1, lambda n: 1.0),
    "send": (0, lambda n: 1.0),
    "recv_": (0, lambda n: 0.0),  # counted by the sender
    # functional collectives (DTensor redistributions, tensor parallelism)
    "all_reduce": _ALL_REDUCE,
    "all_reduce_coalesced": _ALL_REDUCE,
    "all_gather_into_tensor": (0, lambda n: n - 1),
    "all_gather_into_tensor_coalesced": (0, lambda n: n - 1),
    "reduce_scatter_tensor": (0, lambda n: (n - 1) / n),
    "reduce_scatter_tensor_coalesced": (0, lambda n: (n - 1) / n),
    "all_to_all_single": (0, lambda n: (n - 1) / n),
    "broadcast": (0, lambda n: (n - 1) / n),
}


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))


class CollectiveBytes(TorchDispatchMode):
    """Bytes this rank sends per collective op and process group (ring algorithms, see _COLLECTIVES),
    and the number of calls. Groups are named by `labels` (process-group name -> label, e.g. a mesh
    dimension); unlabelled ones by their group name."""

    def __init__(self, labels: dict[str, str]):
        super().__init__()
        self.labels = labels
        self.bytes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    @staticmethod
    def _group(args):
        for a in args:
            if isinstance(a, str):
                with contextlib.suppress(Exception):
                    return dist.distributed_c10d._resolve_process_group(a)
            if isinstance(a, torch.ScriptObject):
                with contextlib.suppress(Exception):
                    return dist.ProcessGroup.unbox(a)
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func._schema.name.split("::")[-1]
        if func.namespace in ("c10d", "_c10d_functional") and op in _COLLECTIVES:
            index, factor = _COLLECTIVES[op]
            group = self._group(args)
            size = group.size() if group is not None else dist.get_world_size()
            label = self.labels.get(group.group_name, group.group_name) if group is not None else "world"
            name = op.strip("_")
            self.bytes[label][name] += _nbytes(args[index]) * factor(size)
            self.calls[label][name] += 1
        return func(*args, **(kwargs or {}))

    def by_group(self) -> dict[str, int]:
        return {g: int(round(sum(ops.values()))) for g, ops in self.bytes.items()}


def _split(out) -> int:
    """How many ranks share the computation of a DTensor result: every mesh dimension on which it
    is sharded (each rank computes a slice) or partial (each rank sums a slice of the reduction)."""
    from torch.distributed.tensor import DTensor

    for t in tree_flatten(out)[0]:
        if isinstance(t, DTensor):
            n = 1
            for dim, placement in enumerate(t.placements):
                if placement.is_shard() or placement.is_partial():
                    n *= t.device_mesh.size(dim)
            return n
    return 1


class _NoModules:
    """Stands in for FlopCounterMode's module tracker: its multi-grad hooks break autograd.grad,
    which torch.distributed.pipelining's backward uses; a per-step total needs no per-module split."""

    parents = ("Global",)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def local_flop_counter():
    """torch's FlopCounterMode, counting what *this rank* computes: a DTensor op reaches a dispatch
    mode with global shapes (its local op runs below the mode), so its count is divided by `_split`."""
    from torch.utils.flop_counter import FlopCounterMode

    class LocalFlopCounter(FlopCounterMode):
        def __init__(self):
            super().__init__(display=False)
            self.mod_tracker = _NoModules()

        def _count_flops(self, func_packet, out, args, kwargs):
            if func_packet in self.flop_registry:
                count = self.flop_registry[func_packet](*args, **kwargs, out_val=out) // _split(out)
                self.flop_counts["Global"][func_packet] += count
            return out

    return LocalFlopCounter()


def mesh_group_labels(mesh) -> dict[str, str]:
    """Process-group name -> mesh dimension, for every dimension (and flattened pairs) of `mesh`."""
    out = {dist.group.WORLD.group_name: "world"}
    for dim in mesh.mesh_dim_names:
        with contextlib.suppress(Exception):
            out[mesh[dim].get_group().group_name] = dim
    from fleetwise.runtime.mesh import _GROUPS

    for dims, group in _GROUPS.items():
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
        v
        for opt in trainer.optimizers.local()
        for s in opt.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    out["buffers"] = total(b for part in trainer.model.parts for b in part.buffers())
    return out


def simulate_rank(cfg, plan, rank: int, steps: int = 2, run_dir=None) -> dict[str, Any]:
    """Run `steps` optimizer steps of rank `rank` of the job `cfg` (any world size) under fake
    tensors and the fake backend, in this process, with the real Trainer. Returns the report.
    run_dir: a folder shared by the ranks simulated together (the pipeline metadata relay)."""
    import tempfile
    from pathlib import Path

    from fleetwise.runtime.mesh import DistEnv
    from fleetwise.runtime.trainer import Trainer

    started = time.perf_counter()
    world = cfg.hardware.world_size
    init_fake_world(rank, world)
    device = torch.device("cpu")  # fake cuda needs a CUDA build of torch: see the module's note
    env = DistEnv(rank, world, 0, device, 0)
    fx = FakeExecution()
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="fleetwise-dryrun-"))
    from fleetwise.config.layout import Layout

    if Layout.of(cfg).pp > 1:
        MetaRelay(run_dir / "pipeline_meta").install()
    trainer = Trainer(cfg, plan, env, run_dir, allocate=fx.allocate(device))
    trainer.memory.samples = steps  # the live-tensor tracker of the real run, on every simulated step
    built = time.perf_counter()
    labels = mesh_group_labels(trainer.mesh)
    for step in range(1, steps + 1):  # the last step is reported (the first has no optimizer state yet)
        comm, flops = CollectiveBytes(labels), local_flop_counter()
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
        "comm_bytes_per_step": comm.by_group(),
        "comm_by_op": {g: {k: int(round(v)) for k, v in ops.items()} for g, ops in comm.bytes.items()},
        "comm_calls": {g: dict(ops) for g, ops in comm.calls.items()},
        "host_reads": fx.host_reads.reads,
        "time_s": {"build": built - started, "steps": time.perf_counter() - built},
        "pid": os.getpid(),
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m fleetwise.runtime.simulate RUN_DIR RANK STEPS`: simulate one rank of the job in
    RUN_DIR (config.yaml, plan.json, as `fleetwise train` writes them) and write
    RUN_DIR/dryrun/rank_RANK.json. Started by `fleetwise dryrun`, one process per rank."""
    import json
    import logging
    import sys
    import warnings
    from pathlib import Path

    from fleetwise import rundir

    run_dir, rank, steps = Path(argv[0]), int(argv[1]), int(argv[2])
    warnings.filterwarnings("ignore")  # torch's fake-backend and FSDP notices, once per rank
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    cfg, plan = rundir.read_config(run_dir), rundir.read_plan(run_dir)
    print(f"dryrun: rank {rank} started", file=sys.stderr, flush=True)
    report = simulate_rank(cfg, plan, rank, steps, run_dir=run_dir / "dryrun")
    out = run_dir / "dryrun" / f"rank_{rank}.json"
    out.write_text(json.dumps(report, indent=1))
    t = report["time_s"]
    print(
        f"dryrun: rank {rank} done (build {t['build']:.1f} s, {steps} steps {t['steps']:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    return 0


if __name__ == "__main__":
    import sys

    from fleetwise.runtime.mesh import exit_finished

    exit_finished(main(sys.argv[1:]))
