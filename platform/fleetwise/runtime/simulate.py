"""Fake execution: run the real per-rank runtime (mesh, parallelize, optimizer, train step) of one
rank of a job of any size, without the memory, the compute or the other ranks.

The pieces, usable on their own (a test mode can take any of them):

- `init_fake_world(rank, world_size)`: the `fake` process-group backend (torch's FakeProcessGroup):
  every collective "succeeds" at once, moving nothing; the DeviceMesh and its subgroups are real.
- `FakeExecution`: a context holding a `FakeTensorMode` (tensors with shapes, dtypes and storages
  but no data). `FakeExecution.allocate` is the `allocate` hook of `runtime.parallelize.parallelize`:
  a meta-built part gets fake storage instead of real memory and initial values.
- `Counters`: one dispatch mode that answers host reads of device scalars with placeholders and
  counts the bytes each collective sends (by mesh dimension) and the FLOPs this rank computes.
- `MetaRelay`: pipelining's stage metadata between simulated ranks, through files.
- `simulate_rank(cfg, plan, rank, steps)`: all of the above around the unchanged `Trainer`, with
  the live-tensor peak from the same tracker the real run uses (`runtime.memory.LiveTensorBytes`,
  through `Trainer.memory`); micro-batches, and alike blocks, sampled at two small counts and scaled (see the sections
  below); returns a JSON-able report.

Traps (torch 2.13, CPU build): DeviceMesh creation and `parallelize_module` / `fully_shard` must run
outside `FakeTensorMode` (mesh coordinates call `nonzero`); only allocation and the steps run inside.
Fake `cuda` tensors cannot be created on a CPU build, so a GPU job is simulated on the cpu device:
bytes are the tensors' own, without the CUDA caching allocator's rounding.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_aten = torch.ops.aten


def init_fake_world(rank: int, world_size: int, backend: str = "nccl") -> None:
    """Join a fake process group of `world_size` ranks as `rank` (no other process needed), whose
    collectives hold the memory the job's real `backend` holds."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    _works_hold_their_tensors()
    _ddp_bucket_indices_on_the_host()
    _reduce_scatter_copies_its_input(backend == "gloo")


def _reduce_scatter_copies_its_input(gloo: bool) -> None:
    """Give the fake backend's reduce-scatter gloo's working copy of its input. gloo reduces a
    copy of the whole input tensor and keeps it until the call returns; NCCL reduces in place.
    Measured with torch 2.13 (2 gloo ranks, `dist.reduce_scatter_single` under LiveTensorBytes):
    the peak is the input and output plus exactly the input's bytes again, fp32 and bf16, 4 KB to
    4 MB. FSDP's reduce-scatter of a vocabulary-wide root (gpt/tiny, vocab 16k, ZeRO-2 x mp 2, bf16:
    its 4.2 MB fp32 gradients) peaks there: the dry run was 4,203,008 B (20%) below the real run.
    FSDP and ZeRO-1 call it synchronously (runtime/zero1.py), so the copy lives for the call.
    Patched where they look it up (`torch.distributed` and `distributed_c10d`), in this simulation
    process only; `gloo` is the simulated job's (a later job in the process sets it again)."""
    from torch.distributed import distributed_c10d as c10d

    _reduce_scatter_copies_its_input.gloo = gloo
    if hasattr(c10d.reduce_scatter_single, "original"):  # installed already
        return
    original = c10d.reduce_scatter_single

    def reduce_scatter_single(output, input, *args, **kwargs):
        # gloo's copy: allocated under the fake mode, so the live-tensor tracker counts it
        copy = torch.empty_like(input) if _reduce_scatter_copies_its_input.gloo else None
        try:
            return original(output, input, *args, **kwargs)
        finally:
            del copy

    reduce_scatter_single.original = original
    c10d.reduce_scatter_single = dist.reduce_scatter_single = reduce_scatter_single


class _Works(list):
    """A list of point-to-point Works that, like gloo's and NCCL's, keeps the tensors they send
    or receive alive for as long as the Works themselves are kept."""

    tensors: list[torch.Tensor]


def _works_hold_their_tensors() -> None:
    """Give the fake backend's point-to-point Works the lifetime of real ones. A gloo (or NCCL)
    send Work holds the tensor it sends until the Work object is dropped; the fake backend's Work
    holds nothing. torch's multi-stage schedules keep every send's Work until the end of the step
    ("wait for them at the end"), so without this every sent activation and gradient would be
    freed early: measured on gpt/tiny, interleaved 1F1B pp2 v2, the dry run was 262,144 B (7%)
    below the real run -- exactly its 16 sends of 16 KiB. Patched where the schedules look it up
    (`schedules._batch_p2p`), in this simulation process only."""
    from torch.distributed.pipelining import schedules

    if hasattr(schedules._batch_p2p, "original"):  # installed already
        return
    original = schedules._batch_p2p

    def batch_p2p(p2p_ops, desc=None):
        works = _Works(original(p2p_ops, desc=desc))
        works.tensors = [op.tensor for op in p2p_ops]
        return works

    batch_p2p.original = original
    schedules._batch_p2p = batch_p2p


def _with_result(out):
    """A c10d op's (tensors..., Work) with a Work whose future holds the op's tensors, as gloo's
    and NCCL's do (an in-place all-reduce: its input, reduced). The fake backend's Work completes
    with None, and DDP's C++ reducer reads the reduced bucket from that future at the end of every
    synchronizing backward (`parseCppCommHookResult`: "expected the hook result is either a Tensor
    or a TensorList found None", torch 2.13). Applied to `c10d.allreduce_` only, the one op whose
    future's value the runtime reads: a Work holding its tensors keeps them alive as long as it is
    kept, and the other ops' Works are left as they are (their peaks are checked against real runs)."""
    if not (isinstance(out, tuple) and out and isinstance(out[-1], torch.ScriptObject)):
        return out
    future = torch.futures.Future()
    future.set_result([t for t in tree_flatten(out[:-1])[0] if isinstance(t, torch.Tensor)])
    return (*out[:-1], torch._C._distributed_c10d._create_work_from_future(future).boxed())


class _HostInts(TorchDispatchMode):
    """Ops on int32 tensors only (and int32 factories) run on real tensors, below every other
    mode; everything else goes on to the fake world. For `_ddp_bucket_indices_on_the_host`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._python_dispatch import _disable_current_modes

        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if all(t.dtype == torch.int32 for t in tensors) and (tensors or kwargs.get("dtype") == torch.int32):
            with _disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _ddp_bucket_indices_on_the_host() -> None:
    """Let DDP rebuild its buckets in the fake world. At the first forward after the first
    backward, DDP's C++ reducer regroups its gradient buckets in the order the gradients arrived
    (`Reducer::rebuild_buckets`) and agrees on the grouping with rank 0 (`sync_bucket_indices`):
    int32 host tensors it writes and reads through accessors, broadcast in between. Under
    FakeTensorMode those tensors have no data ("The tensor has a non-zero number of elements, but
    its data is not allocated yet", torch 2.13), so during the rebuild int32 tensors are real (a
    few bytes per parameter tensor; the fake broadcast leaves this rank's own grouping, which is
    rank 0's: every rank's is the same), while the new buckets themselves are fake. The reducer's
    own code runs unchanged. Patched in this simulation process only."""
    reducer = dist.Reducer
    if hasattr(reducer._rebuild_buckets, "original"):  # installed already
        return
    original = reducer._rebuild_buckets

    def rebuild_buckets(self) -> bool:
        with _HostInts():
            return original(self)

    rebuild_buckets.original = original
    reducer._rebuild_buckets = rebuild_buckets


class NotAlike(RuntimeError):
    """A stage answered for an alike one does not map its metadata to itself (MetaRelay)."""


class MetaRelay:
    """Carries torch.distributed.pipelining's stage metadata (the pickled shapes a stage sends its
    neighbour with send_object_list before the first step) between simulated ranks, through files
    in `folder`: the fake backend moves no data, and a stage cannot infer its input shapes without
    its neighbour's. The stages of one pipeline are therefore simulated at the same time: all of
    them, or, when `folder` holds a stand-ins file (launcher/dryrun.py `stand_ins`: the middle
    stages are alike), only those it lists as running. A stage that does not run is answered from
    the real metadata of an alike one: forward, what stage `forward` sent on, if it equals what it
    received; backward, the same of stage `backward` (that equality makes every alike middle stage
    send on what it receives, see `stand_ins`). An inequality raises NotAlike (the launcher then
    runs every stage)."""

    def __init__(self, folder, timeout_s: float = 1800.0):
        import json
        from pathlib import Path

        from fleetwise import rundir

        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.sent: dict[tuple[int, int], int] = defaultdict(int)
        self.received: dict[tuple[int, int], int] = defaultdict(int)
        plan = self.folder / rundir.STAND_INS_FILE
        self.stand_ins = json.loads(plan.read_text()) if plan.exists() else None

    def rewind(self) -> None:
        """Start the exchange over, for another trainer of the same stages in this process (layer
        sampling): its stages send the same metadata again and read what was sent before."""
        self.sent.clear()
        self.received.clear()

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
        seq = self.received[src, dst]
        self.received[src, dst] += 1
        if self.stand_ins is None or src in self.stand_ins["running"]:
            return self._wait(src, dst, seq)
        # src does not run: answered by the alike stage that does, if it maps its metadata to itself
        s = self.stand_ins["forward"] if src < dst else self.stand_ins["backward"]
        step = 1 if src < dst else -1
        received, sent = self._wait(s - step, s, seq), self._wait(s, s + step, seq)
        if received != sent:
            raise NotAlike(
                f"pipeline stages are not alike: stage {s} received {received!r} from stage {s - step} "
                f"but sent {sent!r} to stage {s + step}, so it cannot answer for stage {src}"
            )
        return sent

    def _wait(self, src: int, dst: int, seq: int):
        import pickle

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
    """`with FakeExecution() as fx:` -- tensors created or computed inside are fake.
    Re-enterable (allocation, then each step)."""

    def __init__(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        # allow_non_fake_inputs: real host tensors (data batches, constants) mix with fake ones
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)

    def __enter__(self) -> FakeExecution:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)

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


def _cpu_attention_formulas() -> dict:
    """FLOP formulas for the CPU flash-attention kernels, which torch's registry lacks (it has the
    CUDA ones): the same counts as torch's flash attention -- forward QK^T and scores.V; backward
    five such matmuls (the scores recomputed, then the gradients of scores, V, Q and K)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    def forward(query, key, value, *args, out_val=None, **kwargs) -> int:
        return sdpa_flop_count(query.shape, key.shape, value.shape)

    def backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)

    return {
        _aten._scaled_dot_product_flash_attention_for_cpu: forward,
        _aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
    }


_DECOMPOSES: dict = {}  # op -> whether it has a CompositeImplicitAutograd decomposition


class Counters(TorchDispatchMode):
    """Everything the dry run counts per op, in one dispatch mode (each mode on the stack costs a
    Python round trip per op, and a DTensor op crosses the stack twice: itself, then its local op):

    - host reads: `aten._local_scalar_dense` (`.item()`, `float(t)`, `bool(t)`, refused by fake
      tensors) answered with a placeholder -- floating and bool scalars read 1 / True (a finite
      flag is finite, a loss or norm is 1.0); integers read 0: the one integer read in the runtime
      is torch.distributed.pipelining's warm-up vote, where 0 means "some stage has no static
      shapes", which is true of fleetwise's stages, so the schedule takes the same dynamic-shape
      path as the real run (its metadata goes through `MetaRelay`); except GradScaler's found-inf
      flags (fp16: the tensors `_amp_foreach_non_finite_check_and_unscale_` writes), which read 0
      -- no overflow, so the optimizer steps as in a healthy step (read as 1.0, every fp16 step
      was a skipped one: no update, no optimizer state);
    - collective bytes this rank sends, per op and process group (ring algorithms, _COLLECTIVES;
      groups named by `labels`: process-group name -> mesh dimension);
    - FLOPs this rank computes, by torch's FLOP formulas (`torch.utils.flop_counter`, with its
      decomposition rule: an op without a formula is decomposed when it can be), a DTensor op's
      global count divided by the ranks that share it (`_split`)."""

    def __init__(self, labels: dict[str, str]):
        from torch.utils.flop_counter import flop_registry

        super().__init__()
        self.labels = labels
        self.formulas = {**flop_registry, **_cpu_attention_formulas()}
        self.reads = 0
        # storages of the live GradScaler found-inf flags; a flag's key leaves with the flag (a
        # freed storage's address is reused: a later tensor there, e.g. a metrics row, would read 0)
        self.found_inf: set[int] = set()
        self.flops = 0
        self.paused = False  # pipelining's one-time stage initialization is not a step's work
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
        if func is _aten._local_scalar_dense.default:
            self.reads += 1
            dtype = args[0].dtype
            if dtype == torch.bool:
                return True
            if args[0].untyped_storage()._cdata in self.found_inf:
                return 0.0
            return 1.0 if dtype.is_floating_point or dtype.is_complex else 0
        if func in _NOT_COUNTED:
            return NotImplemented
        if func is _aten._amp_foreach_non_finite_check_and_unscale_.default:
            key = args[1].untyped_storage()._cdata
            self.found_inf.add(key)
            weakref.finalize(args[1], self.found_inf.discard, key)
        if self.paused:
            return func(*args, **kwargs)
        packet = func._overloadpacket
        if func.namespace in ("c10d", "_c10d_functional"):
            op = func._schema.name.split("::")[-1]
            if op in _COLLECTIVES:
                self._collective(op, args)
            if op == "allreduce_":
                return _with_result(func(*args, **kwargs))
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
            key = torch._C.DispatchKey.CompositeImplicitAutograd
            known = func is not torch.ops.prim.device.default and (
                key in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)
            )
            _DECOMPOSES[func] = known
        return known

    def snapshot(self) -> dict[str, Any]:
        """The counts so far, JSON-able."""
        return {
            "flops": self.flops,
            "bytes": {g: dict(ops) for g, ops in self.bytes.items()},
            "calls": {g: dict(ops) for g, ops in self.calls.items()},
            "reads": self.reads,
        }


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


def state_bytes(trainer, host: list[torch.Tensor] = ()) -> dict[str, int]:
    """Bytes of what outlives a step on this rank, by category (DTensors by their local shard).
    Those in the storages of `host` (a GPU job's offloaded state) count under `host_<category>`
    instead, beside the device's categories."""
    from fleetwise.runtime.trainer import _local

    def size(t) -> int:
        t = _local(t)
        return t.untyped_storage().nbytes() if t.numel() else 0

    seen: set[int] = set()
    on_host = {_local(t).untyped_storage()._cdata for t in host}
    host_bytes: dict[str, int] = defaultdict(int)

    def total(tensors, category: str = "") -> int:
        n = 0
        for t in tensors:
            key = _local(t).untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                if key in on_host:
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


# ------------------------------------------------------------------------------------------------
# Micro-batch sampling. A step repeats the same micro-batch work n times; a job of 192 micro-batches
# is simulated with two small counts na < nb instead (three steps: nb, na, nb), and every per-step
# count of the last two is taken as affine in the count: X(n) = X(na) + (n - na) (X(nb) - X(na)) /
# (nb - na). That is exact for FLOPs and bytes (each micro-batch's work is the same; what happens
# once per step -- FSDP's all-reduce on the last micro-batch, the optimizer -- is in both). It is
# exact for the memory peak when na already holds the steady state, so that only what is held for
# the whole step per micro-batch (the step's input batch, pipelining's receive buffers) grows with
# the count: without a pipeline na = 3 (a first, a middle and a last micro-batch; the middle ones
# are identical); with one, na is the smallest count at which the schedule's own action list
# reaches the same number of micro-batches in flight per stage as at n (`in_flight`).


def _reschedule(schedule, n: int):
    """A schedule of the same class over the same stages, for `n` micro-batches."""
    stages = schedule._stages if hasattr(schedule, "_stages") else schedule._stage
    new = type(schedule)(
        stages, n_microbatches=n, loss_fn=schedule._loss_fn, scale_grads=schedule.scale_grads
    )
    for flag in (
        "_stage_forward_initialized",
        "_stage_backward_initialized",
        "_stages_forward_initialized",
        "_stages_backward_initialized",
    ):
        if hasattr(schedule, flag):
            setattr(new, flag, getattr(schedule, flag))
    return new


def in_flight(schedule, pp_rank: int) -> dict[int, tuple[int, int, int]]:
    """Per stage of this rank, from the schedule's own action list: the most micro-batches whose
    forward has run and whose input backward has not (activations held); the same once the stage
    has run a backward (activations held beside the gradients); and the most whose input backward
    has run and whose weight backward has not (zero-bubble's held inputs)."""
    from torch.distributed.pipelining.schedules import _ComputationType as T

    held: dict[int, list[int]] = defaultdict(
        lambda: [0, 0, 0, 0, 0, 0]
    )  # now, I-W now, maxima, backward seen
    for action in (schedule.pipeline_order or {}).get(pp_rank, []):
        if action is None:
            continue
        h, kind = held[action.stage_index], action.computation_type
        if kind in (T.FORWARD, T.OVERLAP_F_B):
            h[0] += 1
        if kind in (T.FULL_BACKWARD, T.BACKWARD_INPUT, T.OVERLAP_F_B):
            h[0] -= 1
            h[5] = 1
        if kind == T.BACKWARD_INPUT:
            h[1] += 1
        if kind == T.BACKWARD_WEIGHT:
            h[1] -= 1
        h[2] = max(h[2], h[0])
        h[3] = max(h[3], h[0] if h[5] else 0)
        h[4] = max(h[4], h[1])
    return {stage: (h[2], h[3], h[4]) for stage, h in sorted(held.items())}


def sampled_counts(trainer, n: int) -> tuple[int, int] | None:
    """(na, nb) to simulate instead of the job's n micro-batches, or None to run all n (when
    sampling would not be cheaper)."""
    schedule = trainer.model.schedule
    if schedule is None:
        na, nb = 3, 4
        return (na, nb) if na + nb < 2 * n else None
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

    pp_rank = trainer.coords["pp"]
    want = in_flight(schedule, pp_rank)
    # Zero bubble: at the first count that reaches the job's in-flight counts the step's last
    # moments are still its first of their kind -- a chunk's first input-gradient step after a
    # weight step is where FSDP turns the 16-bit weight gradients into its fp32 accumulators, so
    # the peak there lacks state every later round holds; scaled from that count the difference
    # was taken per micro-batch (GPT-3 13B interleaved ZB v2, last stage, from 4 and 6 of 256:
    # 55.7 GB; from 6 and 8: 19.4 GB). The next two counts are taken.
    skip = 1 if isinstance(schedule, (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)) else 0
    # The interleaved schedules run rounds of `microbatches_per_round` (n / max(1, n // pp)): a
    # count with other rounds is another schedule -- a longer warm-up, one more micro-batch in
    # flight -- even where `in_flight`'s maxima agree, and what it adds was scaled per micro-batch
    # (GPT-3 175B interleaved v 2, pp 16, 192 micro-batches, sampled from 48 and 51 (rounds of 17):
    # +9.5 GiB on rank 0). Only counts with the job's rounds are taken.
    per_round = getattr(schedule, "microbatches_per_round", None)
    legal = []
    for k in range(1, n):
        try:
            candidate = _reschedule(schedule, k)
        except Exception:  # the schedule's own rules (e.g. 1F1B: at least one per stage)
            continue
        if getattr(candidate, "microbatches_per_round", None) != per_round:
            continue
        if legal or in_flight(candidate, pp_rank) == want:
            legal.append(k)
        if len(legal) == 2 + skip:
            na, nb = legal[skip:]
            return (na, nb) if na + nb < 2 * n else None
    return None


def _use_microbatches(trainer, full_schedule, k: int) -> None:
    """Make the trainer's next steps run k micro-batches: its data yields k (the same micro-batch
    size), and a pipeline runs the same schedule class for k, keeping its stages' metadata."""
    import dataclasses

    data = trainer.data
    trainer.data = dataclasses.replace(
        data, num_microbatches=k, global_batch_size=k * data.micro_batch_size * data.dp_size
    )
    if full_schedule is None:
        return
    schedule = trainer.model.schedule
    if schedule._n_microbatches != k:
        trainer.model.schedule = _reschedule(schedule, k)
    # the receive buffers of micro-batches this step does not run are set aside (not held), and
    # put back when a later step runs them again
    for stage in trainer.model.stages:
        for infos in (stage.args_recv_info, stage.grad_recv_info):
            aside = _SET_ASIDE.setdefault(id(infos), {})
            for chunk in [c for c in infos if c >= k]:
                aside[chunk] = infos.pop(chunk)
            for chunk in [c for c in aside if c < k]:
                infos[chunk] = aside.pop(chunk)


_SET_ASIDE: dict[int, dict[int, Any]] = {}


class _MetadataSent(Exception):
    """A neighbour-only stage has sent its pipeline metadata: its work is done."""


def _hook_initialization(trainer, counters_of, helper: bool) -> None:
    """Pipelining initializes its stages on the first step (P2P warm-up vote, a metadata forward
    and backward, messages to the neighbours): once per job, not per step, so not counted. A
    helper (a stage simulated only so its neighbours learn their shapes) stops right after."""
    schedule = trainer.model.schedule
    if schedule is None:
        return
    original = schedule._initialize_pp_stages

    def initialize(*args, **kwargs):
        counters = counters_of()
        counters.paused = True
        try:
            out = original(*args, **kwargs)
        finally:
            counters.paused = False
        if helper:
            raise _MetadataSent
        return out

    schedule._initialize_pp_stages = initialize


def _affine(a, b, na: int, nb: int, n: int):
    """X(n) from X(na) = a and X(nb) = b, element-wise over nested dicts of numbers."""
    if isinstance(a, dict) or isinstance(b, dict):
        a, b = a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {}
        return {k: _affine(a.get(k, 0), b.get(k, 0), na, nb, n) for k in {*a, *b}}
    return a + (n - na) * (b - a) / (nb - na)


# ------------------------------------------------------------------------------------------------
# Layer sampling. A stage of alike blocks (GPT's, ERNIE's) repeats the same block work L times: its
# chunks are simulated with 1 and 2 blocks each instead (zero bubble: 2 and 3; under full recompute
# only, see below) (two trainers, each sampling micro-batches
# as above), and every count -- FLOPs, collective bytes and calls, the live-tensor peak and the
# bytes of each state category -- is taken as affine in the block count, X(L) = X(a) + (L - a)
# (X(b) - X(a)). That is exact for FLOPs, bytes and the state (each block holds and computes the
# same, the ZeRO-1 and FSDP shards are per parameter). The peak is scaled per moment of the step
# (each pipeline stage's forwards, backwards and weight steps, then the rest: which one peaks can
# change with the count), and is exact when
# each part's peak holds the same per-block tensors at both counts as at L (in-flight activations,
# gradients and state grow with L; one block's temporaries do not):
# tests/integration/test_dryrun.py holds it against the run of every block. Only when every
# block is alike (the planner's units, names aside), every chunk of this rank holds the same
# count, and sampling is cheaper; otherwise every block runs.

# Where block counts scale exactly, measured against the run of every block
# (tests/integration/test_dryrun.py and probes on gpt/tiny): pipeline stages under full recompute --
# a block keeps only its input until its backward and is recomputed and back-propagated alone, and
# a pipelined chunk's parameters stay gathered for the whole step -- at 1 and 2 blocks (pp 2 with
# FSDP over dp, or with ZeRO-1; TP with sequence parallel). Elsewhere every block runs, because the
# peak is not affine in the block count:
# - without recompute (pp 2 ZeRO-1 stage 0 grows 1,128,256 B a block from 1 to 3 blocks,
#   1,147,192 B to 4, 1,192,448 B a block from 4 to 7);
# - FSDP without a pipeline, which gathers each block's parameters as the block before it runs
#   (ZeRO-3 without recompute grows 470,560 B from 1 to 2 blocks, then 339,232 B a block; with
#   full recompute 2 and 3 blocks scale 38% high at 7).
# The zero-bubble schedules take 2 and 3 blocks: from 1 to 2 blocks a chunk their weight and
# backward steps grew one 16-bit boundary activation less than from 2 on (gpt/tiny interleaved
# zero bubble v 2, pp 2 x dp 2, bf16, full recompute: the last chunk's weight step 2,797,448 /
# 4,788,104 / 6,786,952 B at 1 / 2 / 3 blocks, then 1,998,848 B a block).
LAYER_SAMPLES = (1, 2)
ZERO_BUBBLE_LAYER_SAMPLES = (2, 3)


def sampled_layers(cfg, rank: int) -> tuple[int, tuple[int, int]] | None:
    """This rank's blocks per chunk and the two block counts to simulate instead, or None (every
    block runs): the blocks must be alike, every chunk of this rank must hold the same count, and
    sampling must be cheaper (three steps at each of two counts a + b < the count, ends aside)."""
    from dataclasses import replace

    from fleetwise.config.layout import Layout
    from fleetwise.plan.chunks import split_ends, units_of
    from fleetwise.plan.pipeline import chunk_ranks, split_layers

    m = cfg.model
    if "num_layers" not in type(m).model_fields:  # the family's blocks are not a count (ResNet, CTR)
        return None
    _, blocks, _ = split_ends(units_of(m))
    if len(blocks) != m.num_layers or len({repr(replace(u, name="")) for u in blocks}) != 1:
        return None
    layout, s = Layout.of(cfg), cfg.strategy
    if s.recompute != "full" or layout.pp == 1:
        return None
    chunks = layout.pp * s.virtual_stages
    owners = chunk_ranks(s.schedule, layout.pp, s.virtual_stages)
    counts = split_layers(m.num_layers, chunks, s.layer_split)
    mine = {counts[c] for c in range(chunks) if owners[c] == layout.coords(rank)["pp"]}
    samples = ZERO_BUBBLE_LAYER_SAMPLES if "zero_bubble" in s.schedule else LAYER_SAMPLES
    if len(mine) != 1 or min(mine) <= sum(samples) + 1:
        return None
    return mine.pop(), samples


def with_layers(cfg, per_chunk: int):
    """The job with `per_chunk` blocks in every pipeline chunk (everything else unchanged)."""
    from fleetwise.config.layout import Layout

    layout, s = Layout.of(cfg), cfg.strategy
    chunks = layout.pp * s.virtual_stages if layout.pp > 1 else 1
    model = cfg.model.model_copy(update={"num_layers": per_chunk * chunks})
    update = {"model": model}
    if layout.pp > 1 and s.layer_split is not None:
        update["strategy"] = s.model_copy(update={"layer_split": [per_chunk] * chunks})
    return cfg.model_copy(update=update)


def _one_mesh() -> None:
    """Build the job's DeviceMesh once in this process (layer sampling builds two trainers): a
    second mesh would make a second set of process groups, and the counts are labelled by group.
    A real rank builds one mesh too."""
    from fleetwise.config.layout import Layout

    if hasattr(Layout.build_mesh, "original"):  # installed already
        return
    original, meshes = Layout.build_mesh, {}

    def build_mesh(layout, device_type: str):
        key = (layout.shape, device_type)
        if key not in meshes:
            meshes[key] = original(layout, device_type)
        return meshes[key]

    build_mesh.original = original
    Layout.build_mesh = build_mesh


# ------------------------------------------------------------------------------------------------
# Offload. A GPU job with `strategy.offload` (FSDP's CPUOffloadPolicy) keeps its sharded parameters,
# their gradients and the optimizer state -- and so the optimizer step -- in host RAM; the device
# holds only what FSDP gathers and computes. The dry run simulates every tensor on its one cpu
# device, where FSDP's host<->device copies (`.to(device)` of a shard before its all-gather,
# `.to("cpu")` of a reduce-scatter's output) are no-ops: without the following, the offloaded state
# was counted as device memory (GPT-3 1.3B ZeRO-3 + offload on h100: 4.00 GiB, the same as without
# offload, planned 1.35 GiB). The live-tensor tracker keeps host storages apart (runtime/memory.py
# LiveTensorBytes `host`): the state is host from the start of each step, and here the two copies
# are made what a GPU makes of them. Only for a GPU job: on a CPU device, host and device are one
# memory (the planner says so too), and the real runs never take this path.


def _live_tracker():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from fleetwise.runtime.memory import LiveTensorBytes

    return next(
        (m for m in _get_current_dispatch_mode_stack() if isinstance(m, LiveTensorBytes) and m.separate_host),
        None,
    )


def _offloaded_params(trainer) -> list:
    """FSDP's parameters of this rank that live on the host (FSDPParam with offload_to_cpu)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for part in trainer.model.parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                for group in m._get_fsdp_state()._fsdp_param_groups:
                    out.extend(fp for fp in group.fsdp_params if fp.offload_to_cpu)
    return out


def _offload_on_the_host(trainer, cfg) -> bool:
    """Count the host-resident state of a GPU job with offload as host memory (see above)."""
    if not (cfg.strategy.offload and cfg.hardware.device_type == "cuda" and trainer.model.engine == "fsdp"):
        return False
    _fsdp_copies_cross_to_the_host()

    def host_state() -> list[torch.Tensor]:
        params = _offloaded_params(trainer)
        states = [opt.state.get(fp.sharded_param, {}) for fp in params for opt in trainer.optimizers.local()]
        return (
            [fp._sharded_param_data for fp in params]
            + [fp.sharded_param for fp in params]
            + [fp.sharded_param.grad for fp in params if fp.sharded_param.grad is not None]
            + [v for st in states for v in st.values() if torch.is_tensor(v)]
        )

    trainer.memory.host_state = host_state
    return True


def _fsdp_copies_cross_to_the_host() -> None:
    """FSDP's two copies across the host link, as a GPU makes them (this process only):
    - a shard's all-gather input (`FSDPParam.all_gather_inputs`: `.to(device)`, then the cast to
      the compute dtype) is a device copy, not the host shard itself;
    - the reduce-scatter's output becomes the host gradient (`foreach_reduce`: `.to("cpu")`; the
      device output dies with the call on a GPU): its storage moves to the host.
    (Under mixed precision a GPU first copies the fp32 shard over, then casts: one transient fp32
    shard of one parameter that this does not make.)"""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    if hasattr(_fsdp_param_group.foreach_reduce, "original"):  # installed already
        return
    reduce, inputs = _fsdp_param_group.foreach_reduce, FSDPParam.all_gather_inputs

    def foreach_reduce(fsdp_params, *args, **kwargs):
        out = reduce(fsdp_params, *args, **kwargs)
        tracker = _live_tracker()
        if tracker is not None:
            for fp in fsdp_params:
                if fp.offload_to_cpu and fp.sharded_param.grad is not None:
                    tracker.to_host(fp.sharded_param.grad)
        return out

    def all_gather_inputs(self):
        tracker = _live_tracker()
        if tracker is None or not self.offload_to_cpu:
            return inputs.fget(self)
        with tracker.on_device():
            return [t.clone() if tracker.in_host(t) else t for t in inputs.fget(self)]

    foreach_reduce.original = reduce
    _fsdp_param_group.foreach_reduce = foreach_reduce
    FSDPParam.all_gather_inputs = property(all_gather_inputs)


def _peak_of_forward_backward(trainer) -> list[dict[str, int]]:
    """The live-tensor peaks of each step's forward and backward (all micro-batches), appended to
    the returned list at its end, by moment: under a pipeline schedule each stage's forward,
    backward and weight steps (the action running; "" before the first), else one. The tracker
    then restarts from the bytes live, so that the step's own peak is that of the rest (gradient
    reduction, norm, optimizer). Layer sampling scales each moment on its own (see above)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from fleetwise.runtime.memory import LiveTensorBytes

    def tracker() -> LiveTensorBytes:
        return next(m for m in _get_current_dispatch_mode_stack() if isinstance(m, LiveTensorBytes))

    marks: list[dict[str, int]] = []
    original = trainer.forward_backward

    def forward_backward(step: int):
        t = tracker()
        t.moment, t.moment_peaks = "", {"": t.current}
        out = original(step)
        marks.append(dict(t.moment_peaks))
        t.moment, t.peak = None, t.current
        return out

    def labelled(method, moment: str):
        def run(*args, **kwargs):
            t = tracker()
            if t.moment is not None:
                t.moment = moment
            return method(*args, **kwargs)

        return run

    trainer.forward_backward = forward_backward
    if trainer.model.schedule is not None:
        for stage in trainer.model.stages:
            for name, kind in (
                ("forward_one_chunk", "F"),
                ("backward_one_chunk", "B"),
                ("backward_weight_one_chunk", "W"),
            ):
                setattr(stage, name, labelled(getattr(stage, name), f"{stage.stage_index}{kind}"))
    return marks


def _run_trainer(
    cfg, plan, rank: int, env, fx, run_dir, steps: int, helper: bool, sample: bool
) -> dict[str, Any]:
    """Build the Trainer of `cfg` for this rank and run its steps (micro-batches sampled when
    `sample`): the per-step counts, the peak and the state bytes after the last step, scaled to the
    job's micro-batch count. None for a helper (it stops once its stage metadata is sent)."""
    import sys

    from fleetwise.runtime.trainer import Trainer

    started = time.perf_counter()
    _SET_ASIDE.clear()  # keyed by id(): a previous trainer's receive-buffer dicts are gone
    trainer = Trainer(cfg, plan, env, run_dir, allocate=fx.allocate(env.device))
    built = time.perf_counter()
    labels = mesh_group_labels(trainer.mesh)
    n = cfg.train.accumulate_steps
    counts = sampled_counts(trainer, n) if sample and not helper else None
    full_schedule = trainer.model.schedule
    # sampled: nb first (pipelining sizes its per-micro-batch infrastructure on its first step),
    # then na and nb again, both with optimizer state: the two points every count is scaled from
    per_step = [n] * steps if counts is None else [counts[1], counts[0], counts[1]]
    trainer.memory.samples = len(per_step)  # the live-tensor tracker of the real run, every step
    host = _offload_on_the_host(trainer, cfg)
    current: list[Counters] = []
    _hook_initialization(trainer, lambda: current[-1], helper)
    results, peaks, phases, host_peaks = [], [], [], []
    forward_backward_peaks = _peak_of_forward_backward(trainer)
    layers = len(trainer.model.parts[0].layers) if hasattr(trainer.model.parts[0], "layers") else None
    for step, k in enumerate(per_step, start=1):
        if counts is not None:
            _use_microbatches(trainer, full_schedule, k)
        trainer.memory.peak = trainer.memory.host_peak = 0  # each step's own peak
        counters = Counters(labels)
        current.append(counters)
        try:
            with fx, counters:
                trainer.train_step(step)
        except _MetadataSent:
            return None
        results.append(counters.snapshot())
        # the step's peak: the larger of its forward-backward's moments' and the rest's (the
        # tracker restarts)
        phases.append({**forward_backward_peaks[-1], "rest of the step": trainer.memory.peak})
        peaks.append(max(phases[-1].values()))
        host_peaks.append(trainer.memory.host_peak)
        print(
            f"dryrun: rank {rank} step {step}/{len(per_step)} ({k} micro-batches"
            f"{'' if layers is None else f', {layers} blocks a chunk'}) {time.perf_counter() - built:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    state = state_bytes(trainer, trainer.memory.host_state() if host else ())
    peak, last, host_peak = max(peaks), results[-1], max(host_peaks)
    phase_peaks = {k: max(p.get(k, 0) for p in phases) for k in set().union(*phases)}
    if counts is not None:
        (na, nb), at_na, at_nb = counts, results[-2], results[-1]
        last = _affine(at_na, at_nb, na, nb, n)
        peak = _affine(peaks[-2], peaks[-1], na, nb, n)
        host_peak = _affine(host_peaks[-2], host_peaks[-1], na, nb, n)
        # the rest of the step scaled on its own; every moment of the forward-backward grows in the
        # micro-batch count as the forward-backward's peak does (what grows with it -- held sends,
        # activations in flight -- is the step's, not a moment's): a moment scaled on its own from
        # two small counts can reach, at the first of them, state later rounds hold (GPT-3 13B zero
        # bubble v 2, rank 8, 256 micro-batches read 114 GiB where every micro-batch run reads 19)
        rest = "rest of the step"
        fb = [max(v for k, v in p.items() if k != rest) for p in phases[-2:]]
        grown = _affine(fb[0], fb[1], na, nb, n) - fb[1]
        phase_peaks = {k: v + grown for k, v in phases[-1].items() if k != rest}
        phase_peaks[rest] = _affine(phases[-2][rest], phases[-1][rest], na, nb, n)
    return {
        "counts": last,
        "peak": peak,
        "phase_peaks": phase_peaks,
        "host_peak": host_peak,
        "state": state,
        "reads": results[-1]["reads"],
        "coords": trainer.coords,
        "chunks": trainer.model.chunk_ids,
        "per_step": per_step,
        "scaled": counts is not None,
        "in_flight": {str(k): v for k, v in in_flight(full_schedule, trainer.coords["pp"]).items()}
        if full_schedule is not None
        else None,
        "time_s": {"build": built - started, "steps": time.perf_counter() - built},
    }


def simulate_rank(
    cfg, plan, rank: int, steps: int = 2, run_dir=None, *, helper: bool = False, sample: bool = True
) -> dict[str, Any]:
    """Run `steps` optimizer steps of rank `rank` of the job `cfg` (any world size) under fake
    tensors and the fake backend, in this process, with the real Trainer. Returns the report.
    run_dir: a folder shared by the ranks simulated together (the pipeline metadata relay).
    helper: a pipeline neighbour of a selected rank: build, send the stage metadata, stop.
    sample: simulate two small micro-batch counts and, where the blocks are alike, two small block
    counts, and scale (see above) when that is cheaper."""
    import tempfile
    from pathlib import Path

    from fleetwise import rundir
    from fleetwise.config.layout import Layout
    from fleetwise.runtime.mesh import DistEnv

    started = time.perf_counter()
    world = cfg.hardware.world_size
    init_fake_world(rank, world, cfg.hardware.backend)
    device = torch.device("cpu")  # fake cuda needs a CUDA build of torch: see the module's note
    env = DistEnv(rank, world, 0, device, 0)
    fx = FakeExecution()
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="fleetwise-dryrun-"))
    relay = None
    if Layout.of(cfg).pp > 1:
        relay = MetaRelay(run_dir / rundir.PIPELINE_META_DIR)
        relay.install()
    sampling = sampled_layers(cfg, rank) if sample and not helper else None
    layers, samples = sampling or (None, None)
    if layers is None:
        runs = [_run_trainer(cfg, plan, rank, env, fx, run_dir, steps, helper, sample)]
        if runs[0] is None:
            return {
                "rank": rank,
                "helper": True,
                "time_s": {"build": time.perf_counter() - started, "steps": 0.0},
            }
    else:
        _one_mesh()
        runs = []
        for k in samples:
            if relay is not None:
                relay.rewind()  # the next trainer's stages exchange the same metadata again
            runs.append(
                _run_trainer(with_layers(cfg, k), plan, rank, env, fx, run_dir, steps, helper, sample)
            )
    run = runs[-1]
    last, peak, state, reads = run["counts"], run["peak"], run["state"], run["reads"]
    host_peak = run["host_peak"]
    if layers is not None:
        (la, lb), (a, b) = samples, runs
        last = _affine(a["counts"], b["counts"], la, lb, layers)
        # each moment of the step scaled on its own: which one peaks may change with the block
        # count (the optimizer's at 1 block, the backward's from 2 on; interleaved zero bubble
        # under FSDP's mixed precision, full recompute: a step on the first chunk at 1 and 2
        # blocks, the last chunk's weight step from 3 on). Scaled as one from 1 and 2 blocks,
        # GPT-3 13B zero bubble v 2 read 105,101,568 B less than every block simulated
        pa, pb = a["phase_peaks"], b["phase_peaks"]
        peak = max(_affine(pa[k], pb[k], la, lb, layers) for k in pa.keys() & pb)
        state = _affine(a["state"], b["state"], la, lb, layers)
        host_peak = _affine(a["host_peak"], b["host_peak"], la, lb, layers)
        reads = int(round(_affine(a["reads"], b["reads"], la, lb, layers)))
    state = {k: int(round(v)) for k, v in state.items()}
    host = {k.removeprefix("host_"): state.pop(k) for k in [k for k in state if k.startswith("host_")]}
    peak = int(round(peak))
    state_total = sum(state.values())
    # a GPU job's offloaded state (see "Offload" above): in host RAM, beside the device's peak
    host_memory = {**host, "peak": int(round(host_peak))} if host else None
    return {
        "rank": rank,
        "coords": run["coords"],
        "chunks": run["chunks"],
        "memory_bytes": {**state, "activations_and_temporaries": max(peak - state_total, 0), "peak": peak},
        "host_memory_bytes": host_memory,
        "flops_per_step": int(round(last["flops"])),
        "comm_bytes_per_step": {g: int(round(sum(ops.values()))) for g, ops in last["bytes"].items()},
        "comm_by_op": {g: {k: int(round(v)) for k, v in ops.items()} for g, ops in last["bytes"].items()},
        "comm_calls": {g: {k: int(round(v)) for k, v in ops.items()} for g, ops in last["calls"].items()},
        "host_reads": reads,
        "microbatches": {
            "job": cfg.train.accumulate_steps,
            "simulated": run["per_step"],
            "scaled": run["scaled"],
            "in_flight": run["in_flight"],
        },
        "layers": {
            "job": layers,
            "simulated": list(samples) if layers is not None else None,
            "scaled": layers is not None,
        },
        "time_s": {
            "build": sum(r["time_s"]["build"] for r in runs)
            + (time.perf_counter() - started)
            - sum(r["time_s"]["build"] + r["time_s"]["steps"] for r in runs),
            "steps": sum(r["time_s"]["steps"] for r in runs),
        },
        "pid": os.getpid(),
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m fleetwise.runtime.simulate RUN_DIR RANK STEPS [--helper] [--no-sample]`: simulate
    one rank of the job in RUN_DIR (config.yaml, plan.json, as `fleetwise train` writes them) and
    write RUN_DIR/dryrun/rank_RANK.json. Started by `fleetwise dryrun`, one process per rank."""
    import json
    import logging
    import sys
    import warnings
    from pathlib import Path

    from fleetwise import rundir

    run_dir, rank, steps = Path(argv[0]), int(argv[1]), int(argv[2])
    helper, sample = "--helper" in argv[3:], "--no-sample" not in argv[3:]
    warnings.filterwarnings("ignore")  # torch's fake-backend and FSDP notices, once per rank
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    cfg, plan = rundir.read_config(run_dir), rundir.read_plan(run_dir)
    print(f"dryrun: rank {rank} started", file=sys.stderr, flush=True)
    report = simulate_rank(cfg, plan, rank, steps, run_dir=run_dir / "dryrun", helper=helper, sample=sample)
    out = run_dir / "dryrun" / f"rank_{rank}.json"
    out.write_text(json.dumps(report, indent=1))
    if helper:
        print(f"dryrun: rank {rank} sent its stage metadata", file=sys.stderr, flush=True)
        return 0
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
