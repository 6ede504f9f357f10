"""Every change the dry run makes to torch, and every private torch name it reads, in one module.

The dry run (and the CUDA-semantics tests, through dryrun/fake.py) runs torch's own code on the
fake process-group backend and fake tensors; where that differs from a real job in what it holds
or needs, a function below patches torch in the simulating process only (never in a real rank).
Each says why and what it measured. Every one of the dry run's was checked on torch 2.11, 2.12,
2.13 and 2.14 (`CHECKED`: read in each version's source, and a pipelined hybrid dry run by `make
test-torch`, whose numbers matched 2.13's to the byte; the two test references at the end -- the
CUDA-semantics tests' stand-in device, the planner tests' schedule action lists -- on 2.13);
where torch's internals differ between them, the patch finds the version's own shape by name (pipelining's metadata exchange and initialization, the
reduce-scatter's name), as compat does. On another version `validate` refuses the dry run
(config/rules/torch_version.py) and the rank refuses to start (`require_checked_torch`, for a
caller that skipped validation); a patch whose target is missing raises `compat.Unsupported`
naming it, never an AttributeError.

Private torch names live here and in fleetwise.compat only (tests/unit/architecture/test_private_torch.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._pytree import tree_map_only

from fleetwise import compat

CHECKED = ("2.11", "2.12", "2.13", "2.14")  # config/rules/torch_version.py SUPPORTED


def require_checked_torch() -> None:
    """Refuse a torch the patches below were not checked on (see the module's docstring)."""
    if compat.MINOR not in CHECKED:
        raise compat.unsupported(
            "the dry run (fake process group, fake tensors)",
            CHECKED,
            f"run `fleetwise dryrun` where torch {CHECKED[-1]} is installed; `fleetwise plan` works with any",
        )


def _original(owner, name: str, feature: str):
    """`owner.name`, the torch function a patch wraps, or `compat.Unsupported` naming `feature`."""
    found = getattr(owner, name, None)
    if found is None:
        raise compat.unsupported(f"{feature} ({getattr(owner, '__name__', owner)}.{name})", CHECKED)
    return found


# ------------------------------------------------------------------------------------------------
# The fake backend, given a real backend's memory behaviour (dryrun/fake.py `init_fake_world`).


def fake_store() -> FakeStore:
    """The store of torch's `fake` process-group backend (every collective succeeds at once, moving
    nothing), from torch's testing package (imported with this module: the rank processes' fork
    server preloads it)."""
    return FakeStore()


def reduce_scatter_copies_its_input(gloo: bool) -> None:
    """Give the fake backend's reduce-scatter gloo's working copy of its input. gloo reduces a
    copy of the whole input tensor and keeps it until the call returns; NCCL reduces in place.
    Measured with torch 2.13 (2 gloo ranks, `dist.reduce_scatter_single` under LiveTensorBytes):
    the peak is the input and output plus exactly the input's bytes again, fp32 and bf16, 4 KB to
    4 MB. FSDP's reduce-scatter of a vocabulary-wide root (gpt/tiny, vocab 16k, ZeRO-2 x mp 2, bf16:
    its 4.2 MB fp32 gradients) peaks there: the dry run was 4,203,008 B (20%) below the real run.
    FSDP and ZeRO-1 call it synchronously (runtime/zero1.py), so the copy lives for the call.
    The function both call is `reduce_scatter_single` from torch 2.13 (`reduce_scatter_tensor` is
    then a deprecated alias that calls it), `reduce_scatter_tensor` before (2.11, 2.12: FSDP and
    compat.reduce_scatter_single call that one); the copy itself was measured on 2.13. Patched
    where they look it up (`torch.distributed` and `distributed_c10d`), in this simulation process
    only; `gloo` is the simulated job's (a later job in the process sets it again)."""
    from torch.distributed import distributed_c10d as c10d

    reduce_scatter_copies_its_input.gloo = gloo
    name = "reduce_scatter_single" if hasattr(c10d, "reduce_scatter_single") else "reduce_scatter_tensor"
    original = _original(c10d, name, "the dry run's reduce-scatter copy")
    if hasattr(original, "original"):  # installed already
        return

    def reduce_scatter(output, input, *args, **kwargs):
        # gloo's copy: allocated under the fake mode, so the live-tensor tracker counts it
        copy = torch.empty_like(input) if reduce_scatter_copies_its_input.gloo else None
        try:
            return original(output, input, *args, **kwargs)
        finally:
            del copy

    reduce_scatter.original = original
    setattr(c10d, name, reduce_scatter)
    setattr(dist, name, reduce_scatter)


class _Works(list):
    """A list of point-to-point Works that, like gloo's and NCCL's, keeps the tensors they send
    or receive alive for as long as the Works themselves are kept."""

    tensors: list[torch.Tensor]


def works_hold_their_tensors() -> None:
    """Give the fake backend's point-to-point Works the lifetime of real ones. A gloo (or NCCL)
    send Work holds the tensor it sends until the Work object is dropped; the fake backend's Work
    holds nothing. torch's multi-stage schedules keep every send's Work until the end of the step
    ("wait for them at the end"), so without this every sent activation and gradient would be
    freed early: measured on gpt/tiny, interleaved 1F1B pp2 v2, the dry run was 262,144 B (7%)
    below the real run -- exactly its 16 sends of 16 KiB. Patched where the schedules look it up
    (`schedules._batch_p2p`), in this simulation process only."""
    from torch.distributed.pipelining import schedules

    original = _original(schedules, "_batch_p2p", "the dry run's point-to-point Works")
    if hasattr(original, "original"):  # installed already
        return

    def batch_p2p(p2p_ops, desc=None):
        works = _Works(original(p2p_ops, desc=desc))
        works.tensors = [op.tensor for op in p2p_ops]
        return works

    batch_p2p.original = original
    schedules._batch_p2p = batch_p2p


def allreduce_with_result(out):
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
    future.set_result([t for t in compat.tree_flatten(out[:-1])[0] if isinstance(t, torch.Tensor)])
    return (*out[:-1], torch._C._distributed_c10d._create_work_from_future(future).boxed())


class _HostInts(compat.TorchDispatchMode):
    """Ops on int32 tensors only (and int32 factories) run on real tensors, below every other
    mode; everything else goes on to the fake world. For `ddp_bucket_indices_on_the_host`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in compat.tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if all(t.dtype == torch.int32 for t in tensors) and (tensors or kwargs.get("dtype") == torch.int32):
            with compat.modes_disabled():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def ddp_bucket_indices_on_the_host() -> None:
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
    original = _original(reducer, "_rebuild_buckets", "the dry run's DDP bucket rebuild")
    if hasattr(original, "original"):  # installed already
        return

    def rebuild_buckets(self) -> bool:
        with _HostInts():
            return original(self)

    rebuild_buckets.original = original
    reducer._rebuild_buckets = rebuild_buckets


# ------------------------------------------------------------------------------------------------
# Pipelining (torch.distributed.pipelining).


def route_stage_metadata(send: Callable, recv: Callable) -> None:
    """Route PipelineStage's metadata exchange (the pickled shapes a stage sends its neighbour with
    send_object_list before the first step) through `send(stage, meta, dst_stage)` and
    `recv(stage, src_stage)`, in this process: the fake backend moves no data (dryrun/fake.py
    MetaRelay). Two shapes, found by name:
    - torch 2.12 to 2.14: `_send_meta(stage, meta, dst_stage)` and `_recv_meta(stage, src_stage)`,
      forward and backward metadata: replaced by `send` and `recv`;
    - torch 2.11: `_shape_inference(args, kwargs)` receives the previous stage's output
      shapes and sends its own with `dist.recv_object_list` / `dist.send_object_list` (forward
      only, always from stage - 1 and to stage + 1): during that call, and only there, those two
      go through `send` and `recv`. What it sends is a tuple of meta tensors, which the relay
      compares (stand-ins) and which a meta tensor cannot answer: it travels as `_MetaSpec`s."""
    from torch.distributed.pipelining.stage import PipelineStage

    if hasattr(PipelineStage, "_send_meta") and hasattr(PipelineStage, "_recv_meta"):
        PipelineStage._send_meta = send
        PipelineStage._recv_meta = recv
        _vote_over_the_relay()
        return
    original = _original(PipelineStage, "_shape_inference", "pipeline stage metadata between simulated ranks")
    if hasattr(original, "original"):  # installed already: the relay of this call replaces the last
        original = original.original

    def shape_inference(self, args, kwargs=None):
        def send_object_list(objects, *_, **__):
            send(self, _meta_specs(objects[0]), self.stage_index + 1)

        def recv_object_list(objects, *_, **__):
            objects[0] = _meta_tensors(recv(self, self.stage_index - 1))

        saved = dist.send_object_list, dist.recv_object_list
        dist.send_object_list, dist.recv_object_list = send_object_list, recv_object_list
        try:
            return original(self, args, kwargs)
        finally:
            dist.send_object_list, dist.recv_object_list = saved

    shape_inference.original = original
    PipelineStage._shape_inference = shape_inference


def _vote_over_the_relay() -> None:
    """Let stages on fake ranks infer their shapes from each other, as the relay makes possible.
    torch 2.14's P2P warm-up (`_PipelineSchedule._warmup_p2p`) refuses dynamic shape inference
    across ranks of a `fake` process group ("Stage 0 requires dynamic shape inference, which is
    not supported with a fake process group"): a fake group moves no metadata, and torch cannot
    know that `route_stage_metadata` relays it. During the warm-up, and only there, the backend
    of a fake group reads as another name, so the vote runs as in the real job (HostReads answers
    it "dynamic", dryrun/fake.py) and so does the metadata exchange (over the relay). torch 2.12
    and 2.13 have no such check: there this changes nothing. Patched in this process only."""
    from torch.distributed.pipelining import schedules

    base = schedules._PipelineSchedule
    warmup = getattr(base, "_warmup_p2p", None)
    if warmup is None or hasattr(warmup, "original"):  # a torch without it, or installed already
        return

    def warmup_p2p(self, *args, **kwargs):
        get_backend = dist.get_backend

        def backend(group=None):
            name = get_backend(group)
            return "fake (metadata relayed)" if name == "fake" else name

        dist.get_backend = backend
        try:
            return warmup(self, *args, **kwargs)
        finally:
            dist.get_backend = get_backend

    warmup_p2p.original = warmup
    base._warmup_p2p = warmup_p2p


@dataclasses.dataclass(frozen=True)
class _MetaSpec:
    """A meta tensor by what it says, comparable by value (a meta tensor's `==` has no answer)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def _meta_specs(tree):
    return tree_map_only(
        torch.Tensor, lambda t: _MetaSpec(tuple(t.shape), t.stride(), t.dtype, t.requires_grad), tree
    )


def _meta_tensors(tree):
    def tensor(s: _MetaSpec) -> torch.Tensor:
        return torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta").requires_grad_(
            s.requires_grad
        )

    return tree_map_only(_MetaSpec, tensor, tree)


def wrap_stage_initialization(schedule, wrap: Callable[[Callable], Callable]) -> None:
    """Replace `schedule`'s one-time stage initialization (the P2P warm-up, a metadata forward (and
    from 2.12 on a backward), messages to the neighbours) by `wrap(original)`, on this schedule object
    only. The method, called at every step (it returns at once once done): torch 2.12 to 2.14:
    `_initialize_pp_stages`; torch 2.11: `_initialize_stage` (single-stage schedules) or
    `_initialize_stages` (multi-stage ones)."""
    for name in ("_initialize_pp_stages", "_initialize_stages", "_initialize_stage"):
        if hasattr(schedule, name):
            setattr(schedule, name, wrap(getattr(schedule, name)))
            return
    raise compat.unsupported(
        f"the dry run's pipeline initialization hook ({type(schedule).__name__})", CHECKED
    )


def microbatch_count(schedule) -> int:
    """The micro-batches a schedule runs per step."""
    return schedule._n_microbatches


def reschedule(schedule, n: int):
    """A schedule of the same class over the same stages, for `n` micro-batches, that knows its
    stages are initialized already (single-stage schedules keep `_stage` and
    `_stage_*_initialized`, multi-stage ones `_stages` and `_stages_*_initialized`: the same on
    every version in CHECKED)."""
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


# ------------------------------------------------------------------------------------------------
# FSDP with CPU offload (dryrun/rank.py "Offload").


def offloaded_fsdp_params(parts) -> list:
    """FSDP's parameters in the modules of `parts` that live on the host (FSDPParam with
    offload_to_cpu). A module's FSDP state holds its parameter groups as a list
    (`_fsdp_param_groups`, torch 2.12 on) or as one group or None (`_fsdp_param_group`, 2.11)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for part in parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                state = m._get_fsdp_state()
                groups = getattr(state, "_fsdp_param_groups", None)
                if groups is None:
                    groups = [g] if (g := state._fsdp_param_group) is not None else []
                for group in groups:
                    out.extend(fp for fp in group.fsdp_params if fp.offload_to_cpu)
    return out


def sharded_data(fsdp_param) -> torch.Tensor:
    """The flat, padded host storage of an FSDPParam's shard."""
    return fsdp_param._sharded_param_data


def fsdp_copies_cross_to_the_host(live_tracker: Callable[[], Any]) -> None:
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
        tracker = live_tracker()
        if tracker is not None:
            for fp in fsdp_params:
                if fp.offload_to_cpu and fp.sharded_param.grad is not None:
                    tracker.to_host(fp.sharded_param.grad)
        return out

    def all_gather_inputs(self):
        tracker = live_tracker()
        if tracker is None or not self.offload_to_cpu:
            return inputs.fget(self)
        with tracker.on_device():
            return [t.clone() if tracker.in_host(t) else t for t in inputs.fget(self)]

    foreach_reduce.original = reduce
    _fsdp_param_group.foreach_reduce = foreach_reduce
    FSDPParam.all_gather_inputs = property(all_gather_inputs)


# ------------------------------------------------------------------------------------------------
# A stand-in device: the CUDA-semantics tests (tests/helpers/cuda_semantics.py) run a job on the
# `meta` device with NCCL's rule that a collective takes device tensors only. What FSDP2 and DDP
# do differently on a device without data, and only that, is changed here (checked on torch 2.13,
# the only version those tests run on).


@contextlib.contextmanager
def fsdp_and_ddp_on_a_stand_in_device(device: torch.device, pin: Callable[[torch.Tensor], Any]):
    """While active: FSDP2 places its parameters on `device` (it asks the mesh's device type,
    which has no device module), accepts meta parameters, and makes the host copy of an offloaded
    shard that it skips for a meta parameter (expecting it to be materialised later), pinned by
    `pin` where its policy pins; DDP skips its start-up checks, which compare parameter data
    across ranks (meaningless without data)."""
    from unittest import mock

    from torch.distributed.fsdp._fully_shard import _fsdp_init
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    init = FSDPParam._init_sharded_param

    def init_with_host_copy(self, param, dev, *rest):
        init(self, param, dev, *rest)
        if self.offload_to_cpu and self._sharded_param_data.is_meta:
            host = torch.zeros(self.padded_sharded_param_size, dtype=self._sharded_param_data.dtype)
            self._sharded_param_data = host.view(-1)
            rows = self.sharded_param._local_tensor.size(0) if host.dim() else 0
            local = host.narrow(0, 0, rows) if host.dim() else host
            self.sharded_param = torch.nn.Parameter(
                self.to_sharded_dtensor(local), requires_grad=param.requires_grad
            )
            self._setattr_on_modules(self.sharded_param)
            if self.pin_memory:  # as FSDP pins the host copy of a device parameter
                pin(host)

    ddp = "torch.nn.parallel.distributed"
    with contextlib.ExitStack() as stack:
        for p in (
            mock.patch(f"{ddp}._verify_param_shape_across_processes", lambda *a, **k: None),
            mock.patch(f"{ddp}._sync_module_states", lambda *a, **k: None),
            mock.patch.object(_fsdp_init, "_get_device_from_mesh", lambda mesh: device),
            mock.patch.object(FSDPParamGroup, "_validate_no_meta_params", lambda self: None),
            mock.patch.object(FSDPParam, "_init_sharded_param", init_with_host_copy),
        ):
            stack.enter_context(p)
        yield


class _FirstBuckets:
    """A DDP reducer that keeps its first bucket order: DDP re-buckets after the first backward,
    broadcasting rank 0's order, and with no data in the broadcast that order is not one."""

    def __init__(self, reducer):
        self.reducer = reducer

    def _rebuild_buckets(self):
        return False

    def __getattr__(self, name):
        return getattr(self.reducer, name)


def ddp_keeps_its_first_buckets(ddp) -> None:
    """Make a DDP module's reducer keep the buckets it started with (the stand-in device)."""
    ddp.reducer = _FirstBuckets(ddp.reducer)


# ------------------------------------------------------------------------------------------------
# A pipeline schedule's own action lists without stages or a process group: the reference the
# planner's pipeline terms are held to (tests/unit/plan/test_planner.py: micro-batches in flight,
# weight steps waiting, receive-buffer sets, the bubble). Read in torch 2.13's source, where those
# tests run (`make test-torch` runs them on another version: a renamed internal fails by name).


def action_lists(schedule_cls, pp: int, virtual: int, n: int) -> dict[int, list]:
    """Per pipeline rank, the compute actions `schedule_cls` (a multi-stage schedule) runs for `n`
    micro-batches over pp x `virtual` stages, empty slots dropped: only its order generator runs,
    on an object holding the attributes that generator reads."""
    sched = schedule_cls.__new__(schedule_cls)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = pp, virtual, n
    sched.number_of_rounds = max(1, n // pp)
    sched.microbatches_per_round = n // sched.number_of_rounds
    sched._num_stages = sched.num_stages = pp * virtual
    order = _original(sched, "_calculate_single_rank_operations", "a schedule's action lists")
    return {r: [a for a in order(r) if a is not None] for r in range(pp)}


def lowered_action_lists(
    compute: dict[int, list], stage_to_rank: Callable[[int], int], num_stages: int
) -> dict[int, list]:
    """`compute` (rank -> actions) with the sends and receives torch's runtime adds between ranks."""
    from torch.distributed.pipelining import schedules

    lower = _original(schedules, "_add_send_recv", "a schedule's lowered action lists")
    return lower(compute, stage_to_rank=stage_to_rank, num_stages=num_stages)
