"""What the dry run counts per rank and step: the FLOPs this rank computes, the bytes each
collective sends (by mesh dimension), host reads of device scalars (answered, dryrun/fake.py
HostReads) -- all in one dispatch mode, `Counters` -- and the bytes of what outlives a step.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from fleetwise import compat
from fleetwise.dryrun import patches
from fleetwise.dryrun.fake import HostReads
from fleetwise.models.flops import cpu_attention_formulas

_aten = torch.ops.aten


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
    # point-to-point (pipelining's stages; the context-parallel ring's steps): batch_isend_irecv
    # dispatches one c10d send / recv_ per op, on the op's group (counted under its mesh dimension)
    "send": (0, lambda n: 1.0),
    "recv_": (0, lambda n: 0.0),  # counted by the sender
    # all-to-alls (context parallelism: ulysses' all_to_all_single): every rank keeps 1/n of its
    # input and sends the rest
    "alltoall_base_": (1, lambda n: (n - 1) / n),
    "alltoall_": (1, lambda n: (n - 1) / n),
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
    return sum(t.numel() * t.element_size() for t in compat.tree_flatten(x)[0] if isinstance(t, torch.Tensor))


def _split(out) -> int:
    """How many ranks share the computation of a DTensor result: every mesh dimension on which it
    is sharded (each rank computes a slice) or partial (each rank sums a slice of the reduction)."""
    from torch.distributed.tensor import DTensor

    for t in compat.tree_flatten(out)[0]:
        if isinstance(t, DTensor):
            n = 1
            for dim, placement in enumerate(t.placements):
                if placement.is_shard() or placement.is_partial():
                    n *= t.device_mesh.size(dim)
            return n
    return 1


# ops FlopCounterMode leaves to the tensor's own dispatch (metadata queries)
_NOT_COUNTED = {
    _aten.sym_is_contiguous.default,
    _aten.is_contiguous.default,
    _aten.is_contiguous.memory_format,
    _aten.is_strides_like_format.default,
    _aten.is_non_overlapping_and_dense.default,
    _aten.size.default,
    _aten.sym_size.default,
    _aten.stride.default,
    _aten.sym_stride.default,
    _aten.storage_offset.default,
    _aten.sym_storage_offset.default,
    _aten.numel.default,
    _aten.sym_numel.default,
    _aten.dim.default,
    torch.ops.prim.layout.default,
}


_DECOMPOSES: dict = {}  # op -> whether it has a CompositeImplicitAutograd decomposition


class Counters(compat.TorchDispatchMode):
    """Everything the dry run counts per op, in one dispatch mode (each mode on the stack costs a
    Python round trip per op, and a DTensor op crosses the stack twice: itself, then its local op):

    - host reads: `aten._local_scalar_dense` (`.item()`, `float(t)`, `bool(t)`, refused by fake
      tensors) answered with a placeholder (dryrun/fake.py HostReads: 1.0 / True, integers and
      GradScaler's found-inf flags 0);
    - collective bytes this rank sends, per op and process group (ring algorithms, _COLLECTIVES;
      groups named by `labels`: process-group name -> mesh dimension);
    - FLOPs this rank computes, by torch's FLOP formulas (`torch.utils.flop_counter`, with its
      decomposition rule: an op without a formula is decomposed when it can be), a DTensor op's
      global count divided by the ranks that share it (`_split`)."""

    def __init__(self, labels: dict[str, str]):
        from torch.utils.flop_counter import flop_registry, shape_wrapper

        super().__init__()
        self.labels = labels
        # torch's formulas (wrapped to take tensors) and the CPU attention kernels' (models/flops.py)
        self.formulas = {
            **flop_registry,
            **{op: shape_wrapper(f) for op, f in cpu_attention_formulas().items()},
        }
        self.host_reads = HostReads()
        self.flops = 0
        self.paused = False  # pipelining's one-time stage initialization is not a step's work
        self.bytes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    @staticmethod
    def _group(args):
        for a in args:
            if isinstance(a, str):
                with contextlib.suppress(Exception):
                    return compat.resolve_process_group(a)
            if isinstance(a, torch.ScriptObject):
                with contextlib.suppress(Exception):
                    return dist.ProcessGroup.unbox(a)
        return None

    def _collective(self, op: str, args) -> None:
        index, factor = _COLLECTIVES[op]
        group = self._group(args)
        size = group.size() if group is not None else dist.get_world_size()
        label = self.labels.get(group.group_name, group.group_name) if group is not None else "world"
        name = op.strip("_")
        self.bytes[label][name] += _nbytes(args[index]) * factor(size)
        self.calls[label][name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is compat.SCALAR_READ:
            return self.host_reads.answer(args[0])
        if func in _NOT_COUNTED:
            return NotImplemented
        self.host_reads.note(func, args)
        if self.paused:
            return func(*args, **kwargs)
        packet = func.overloadpacket
        if func.namespace in ("c10d", "_c10d_functional"):
            op = func.name().split("::")[-1].split(".")[0]
            if op in _COLLECTIVES:
                self._collective(op, args)
            if op == "allreduce_":
                return patches.allreduce_with_result(func(*args, **kwargs))
        formula = self.formulas.get(packet)
        # as FlopCounterMode does (its registry holds packets, so every overload is tried): count
        # what an op decomposes into, where it decomposes (entering this mode again only then)
        if self._decomposes(func):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out) // _split(out)
        return out

    @staticmethod
    def _decomposes(func) -> bool:
        """Whether `func.decompose` can decompose it (OpOverload.decompose's own test), cached per op."""
        known = _DECOMPOSES.get(func)
        if known is None:
            known = func is not torch.ops.prim.device.default and func.has_kernel_for_dispatch_key(
                torch.DispatchKey.CompositeImplicitAutograd
            )
            _DECOMPOSES[func] = known
        return known

    def snapshot(self) -> dict[str, Any]:
        """The counts so far, JSON-able."""
        return {
            "flops": self.flops,
            "bytes": {g: dict(ops) for g, ops in self.bytes.items()},
            "calls": {g: dict(ops) for g, ops in self.calls.items()},
            "reads": self.host_reads.reads,
        }


def mesh_group_labels(mesh, *more) -> dict[str, str]:
    """Process-group name -> mesh dimension, for every dimension (and flattened pairs) of `mesh`,
    and of the meshes `more` (the experts' [edp, ep] mesh: runtime/expert_parallel.py), so that
    their traffic is counted under the planner's names ("ep", "edp") rather than c10d's numbers."""
    out = {dist.group.WORLD.group_name: "world"}
    for m in (mesh, *(x for x in more if x is not None)):
        for dim in m.mesh_dim_names:
            with contextlib.suppress(Exception):
                out[m[dim].get_group().group_name] = dim
    from fleetwise.runtime.mesh import flattened_groups

    for dims, group in flattened_groups().items():
        out[group.group_name] = "+".join(dims)
    return out


def state_bytes(trainer, host: list[torch.Tensor] = ()) -> dict[str, int]:
    """Bytes of what outlives a step on this rank, by category (DTensors by their local shard).
    Those in the storages of `host` (a GPU job's offloaded state) count under `host_<category>`
    instead, beside the device's categories."""
    from fleetwise.runtime.trainer import _local

    def size(t) -> int:
        t = _local(t)
        return t.untyped_storage().nbytes() if t.numel() else 0

    def key(t) -> int:
        return compat.storage_key(_local(t).untyped_storage())

    seen: set[int] = set()
    on_host = {key(t) for t in host}
    host_bytes: dict[str, int] = defaultdict(int)

    def total(tensors, category: str = "") -> int:
        n = 0
        for t in tensors:
            k = key(t)
            if k not in seen:
                seen.add(k)
                if k in on_host:
                    host_bytes[category] += size(t)
                else:
                    n += size(t)
        return n

    params = list(trainer.model.parameters())
    # ZeRO-1's own: the gradient buffers, and the fp32 masters (optimizer state, as in Megatron)
    engine = trainer.optimizers.engine_tensors()
    out = {"params": total(params, "params")}
    out["grads"] = total([p.grad for p in params if p.grad is not None] + engine["grads"], "grads")
    out["optimizer"] = total(
        [
            v
            for opt in trainer.optimizers.local()
            for s in opt.state.values()
            for v in s.values()
            if torch.is_tensor(v)
        ]
        + engine["optimizer"],
        "optimizer",
    )
    out["buffers"] = total(b for part in trainer.model.parts for b in part.buffers())
    if host:
        out.update({f"host_{k}": host_bytes.get(k, 0) for k in ("params", "grads", "optimizer")})
    return out
