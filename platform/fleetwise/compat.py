"""The one door to torch's private names and to the differences between torch versions.

fleetwise uses what PyTorch ships, and a few things it needs are private (a leading underscore:
no promise across releases) or appeared in a recent release only. Every such use is here, and
nowhere else in the package but the dry run's own patches (fleetwise.dryrun.patches), so that a
new torch release is checked in two files. `CHECKED` at the end says, for each entry, the torch
versions it was checked on (read in that version's source, and run: `make test-torch`); on any
other version an entry takes a public fallback where one exists (the collectives), finds the
version's shape where torch has two (the pipeline receive buffers: torch's own stage where it has
neither), or raises `Unsupported` when used -- a clear error naming the installed version and the
feature, never an AttributeError from inside a rank: a name torch lacks is a `_Missing`, and a
function that reads internals is an `_entry`, which turns a missing name or a changed signature
into `Unsupported` there. (The few names imported at the top have been in torch since 2.0.)
`validate` refuses a torch older than the oldest version checked (config/rules/torch_version.py).

tests/unit/architecture/test_private_torch.py holds the rule: a private torch name anywhere else in the package
fails it.

This module imports only torch (and the standard library); it is the bottom of the import order.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
)
from torch.utils._pytree import tree_flatten

__all__ = ["FakeTensorMode", "TorchDispatchMode", "is_fake", "tree_flatten"]

log = logging.getLogger(__name__)

VERSION = torch.__version__.split("+")[0]
MINOR = ".".join(VERSION.split(".")[:2])  # "2.13"


# The torch versions every entry was checked on (read in each version's source, and run by
# `make test-torch`: scripts/test_torch.py): the supported range of pyproject.toml and of
# `validate` (config/rules/torch_version.py SUPPORTED, which states it without importing torch).
TESTED = ("2.11", "2.12", "2.13", "2.14")


class Unsupported(RuntimeError):
    """A torch feature fleetwise needs is missing, or changed, on the installed torch."""


def unsupported(feature: str, checked: tuple[str, ...] = TESTED, instead: str = "") -> Unsupported:
    """The error for `feature` on a torch where its internals are not what fleetwise was checked on."""
    fix = instead or f"install torch {checked[-1]} (pip install 'torch=={checked[-1]}.*')"
    return Unsupported(
        f"{feature}: fleetwise uses torch internals here that were checked on torch {', '.join(checked)}, "
        f"and the installed torch is {torch.__version__}: {fix}"
    )


class _Missing:
    """Stands for a torch internal the installed torch lacks: calling it, or reading from it,
    raises Unsupported (importing this module does not: a job that never uses it runs)."""

    def __init__(self, what: str):
        self.what = what

    def __call__(self, *args, **kwargs):
        raise unsupported(self.what)

    def __getattr__(self, name: str):
        raise unsupported(self.what)


def _find(owner, path: str):
    """`owner.<path>`, or a `_Missing` standing for it."""
    found = owner
    for part in path.split("."):
        found = getattr(found, part, None)
        if found is None:
            return _Missing(f"{getattr(owner, '__name__', owner)}.{path}")
    return found


def _entry(feature: str, checked: tuple[str, ...] = TESTED):
    """Decorates an entry that reads torch internals: on a torch in `checked` it is the function
    itself (no wrapper, no cost: an AttributeError there is a fleetwise bug and shows as one); on
    any other torch an AttributeError, ImportError or TypeError from inside it (a private name gone
    or a signature changed) becomes `Unsupported` naming `feature` and the installed version."""

    def decorate(fn: Callable) -> Callable:
        if MINOR in checked:
            return fn

        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except (AttributeError, ImportError, TypeError) as e:
                raise unsupported(feature, checked) from e

        return guarded

    return decorate


# ------------------------------------------------------------------------------------------------
# Dispatch modes, pytrees, fake tensors (the live-tensor tracker, the dry run's counters), imported
# above: the same names and behaviour on every version in TESTED (present since 2.0).


@_entry("the dispatch-mode stack (memory tracking, the dry run)")
def dispatch_modes() -> list:
    """The dispatch modes active now, outermost first."""
    return _get_current_dispatch_mode_stack()


@_entry("running below every dispatch mode (memory tracking, the dry run)")
def modes_disabled():
    """A context in which no dispatch mode is active (ops run on real tensors, below every mode)."""
    return _disable_current_modes()


# ------------------------------------------------------------------------------------------------
# Tensors and storages.


@_entry("telling tensor storages apart (the live-tensor memory tracker)")
def storage_key(storage) -> int:
    """A key that names one storage while it lives (a tensor's `untyped_storage()` is a new
    Python object per call; the storage it wraps is not)."""
    return storage._cdata


# torch.distributed.tensor.DTensor, imported on first use: the import takes ~0.9 s (-X importtime),
# which compat's users that hold no DTensor (a checkpoint export, calibrate's probes) need not pay
_DTensor: type | None = None


@_entry("a DTensor's local shard")
def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard as it is held (no autograd view, unlike `to_local()`); others as they
    are. (Called for every op's output by the memory tracker: the import is done once.)"""
    global _DTensor
    if _DTensor is None:
        from torch.distributed.tensor import DTensor as _DTensor
    return t._local_tensor if isinstance(t, _DTensor) else t


# Multi-tensor kernels (one launch for a list of tensors): what torch.optim and
# clip_grad_norm_ use themselves.
foreach_norm = _find(torch, "_foreach_norm")
foreach_mul_ = _find(torch, "_foreach_mul_")
foreach_copy_ = _find(torch, "_foreach_copy_")

# ATen's own operators with a leading underscore: the dispatcher's names, not a Python API.
# Every one below is present on every version in TESTED. Compared by identity: where one
# is missing, nothing matches it (the attention kernels: the ones present are saved).
_aten = torch.ops.aten
SCALAR_READ = _find(_aten, "_local_scalar_dense.default")  # `.item()`, `float(t)`, `bool(t)`
TO_COPY = _find(_aten, "_to_copy.default")  # `.to(device / dtype)`: a copy across devices among others
PIN_MEMORY = _find(_aten, "_pin_memory.default")  # `.pin_memory()`
AMP_UNSCALE = _find(_aten, "_amp_foreach_non_finite_check_and_unscale_.default")  # GradScaler's check
SDPA_CPU = _find(_aten, "_scaled_dot_product_flash_attention_for_cpu")
SDPA_CPU_BACKWARD = _find(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
SDPA_KERNELS = tuple(  # the attention kernels scaled_dot_product_attention dispatches to
    op
    for op in (
        _find(_aten, "_scaled_dot_product_flash_attention.default"),
        _find(_aten, "_scaled_dot_product_flash_attention_for_cpu.default"),
        _find(_aten, "_scaled_dot_product_efficient_attention.default"),
        _find(_aten, "_scaled_dot_product_cudnn_attention.default"),
    )
    if not isinstance(op, _Missing)
)
# the functional collectives DTensor issues (torch.distributed._functional_collectives)
FUNCTIONAL_REDUCE_SCATTER = _find(torch.ops, "_c10d_functional.reduce_scatter_tensor.default")
FUNCTIONAL_ALL_REDUCE = _find(torch.ops, "_c10d_functional.all_reduce.default")


# ------------------------------------------------------------------------------------------------
# Mixture of experts (models/moe.py).
_GROUPED_MM_VERSIONS = ("2.13",)  # run here on 2.13's CPU build; elsewhere the experts' loop (same numbers)
GROUPED_MM = _find(_aten, "_grouped_mm.default")  # selective recompute saves its output like a matmul's
_GROUPED_MM_DTYPES = {"cpu": (torch.float32, torch.bfloat16), "cuda": (torch.bfloat16,)}


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `grouped_mm` runs these operands: torch 2.13's `torch._grouped_mm` runs on the CPU in
    fp32 and bf16 and on CUDA in bf16 (Hopper or newer); 16-bit operands need 16-byte aligned rows
    (widths a multiple of 8). Everywhere else the experts run as a loop of matmuls."""
    if MINOR not in _GROUPED_MM_VERSIONS or not hasattr(torch, "_grouped_mm"):
        return False
    device = x.device.type
    if x.dtype != w.dtype or x.dtype not in _GROUPED_MM_DTYPES.get(device, ()):
        return False
    if x.dtype != torch.float32 and (x.shape[-1] % 8 or w.shape[-2] % 8):
        return False
    return device != "cuda" or torch.cuda.get_device_capability(x.device) >= (9, 0)


@_entry("the experts' grouped GEMM (torch._grouped_mm)", _GROUPED_MM_VERSIONS)
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, in] (rows grouped by expert; `offsets` [E] int32: where each expert's rows end) times
    each expert's w[e]ᵀ (w [E, out, in]) -> [N, out], in one kernel, differentiable. (Its backward
    needs a gradient with real strides: an expanded one, as `y.sum().backward()` gives, fails.)"""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


@_entry("telling a recompute inside the backward from a forward")
def in_backward() -> bool:
    """Whether autograd's engine is running a backward now (activation recompute runs a block's
    forward again there: what it counts must not count twice)."""
    return torch._C._current_graph_task_id() != -1


# ------------------------------------------------------------------------------------------------
# Modules.
# BatchNorm1d/2d/3d, SyncBatchNorm and the lazy ones (fallback: the four public classes)
BATCH_NORMS = getattr(nn.modules.batchnorm, "_BatchNorm", None) or (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
)


@_entry("activation checkpointing (strategy.recompute)")
def checkpoint_wrapper(module: nn.Module, **kwargs) -> nn.Module:
    """torch.distributed's activation-checkpoint wrapper (the one torchtitan applies per block)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module, **kwargs)


@_entry("the experts' token exchange (strategy.ep_degree)")
def all_to_all_autograd(x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    """Variable-split all-to-all whose backward sends the gradients back the same way: the
    functional collective torchtitan uses (torch.distributed.nn.functional's is deprecated for
    it); its result is waited for here, where the rows are needed next anyway."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x, recv, send, group))


@_entry("expert parallelism beside DDP (strategy.ep_degree)")
def ddp_ignore(module: nn.Module, names: list[str]) -> None:
    """Keep DDP's hands off `names` (parameters another engine reduces: the expert-parallel experts,
    DTensors DDP cannot bucket), through the static method torch's own DTensor-aware wrappers
    use (on DistributedDataParallel since torch 1.8)."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


@_entry("GradScaler's overflow flags (train.precision=fp16)")
def scaler_found_inf(scaler, optimizer) -> list[torch.Tensor]:
    """GradScaler's found-inf flags of `optimizer` (one per device) after `unscale_`, which torch
    keeps per optimizer (its ShardedGradScaler reads them the same way)."""
    return list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())


@_entry("restoring the LR schedule on resume")
def set_last_lr(scheduler, lrs: list[float]) -> None:
    """What an LR scheduler's `get_last_lr()` returns, set after moving it by hand (a resume): torch
    keeps it in a private field it writes in `step()`."""
    scheduler._last_lr = lrs


@_entry("torch.compile's graph counters (train.compile)")
def compile_counters() -> dict:
    """torch.compile's counters (`stats`: unique_graphs, `graph_break`: reasons)."""
    from torch._dynamo.utils import counters

    return counters


def quiet_redistribute_logs() -> None:
    """Silence DTensor's redistribution notices (one per two-dim gradient-norm reduction: expected
    here, and they would drown the log). The logger is named after torch's private module."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


# ------------------------------------------------------------------------------------------------
# Collectives and process groups.


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Reduce-scatter a flat `input` into this rank's `output` slice. `dist.reduce_scatter_single`
    appeared in torch 2.13 (2.13, 2.14); before it, `dist.reduce_scatter_tensor` takes the same
    arguments and does the same (2.11, 2.12; from 2.13 a deprecated alias of the other). Looked up
    at the call: the dry run patches it. gloo jobs take ZeRO-1's all-reduce path: this one runs on
    NCCL, and on gloo in tests/unit/test_compat_collectives.py, both ways."""
    if hasattr(dist, "reduce_scatter_single"):
        dist.reduce_scatter_single(output, input, group=group)
    else:
        dist.reduce_scatter_tensor(output, input, group=group)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """All-gather every rank's `input` into the flat `output`: `dist.all_gather_single` from torch
    2.13 (2.13, 2.14), `dist.all_gather_into_tensor` before it (2.11, 2.12)."""
    if hasattr(dist, "all_gather_single"):
        dist.all_gather_single(output, input, group=group)
    else:
        dist.all_gather_into_tensor(output, input, group=group)


@_entry("pipelining's split backward (calibrate's zero-bubble probe)")
def stage_backward_split():
    """Pipelining's backward passes (`stage_backward`, and the zero-bubble split into
    `stage_backward_input` + `stage_backward_weight`), which `fleetwise calibrate` times on their
    own (the same names and signatures on every version in TESTED)."""
    try:
        from torch.distributed.pipelining import _backward
    except ImportError as e:  # pragma: no cover - a torch without pipelining's backward module
        raise unsupported("pipelining's split backward (calibrate's zero-bubble probe)") from e
    return _backward.stage_backward, _backward.stage_backward_input, _backward.stage_backward_weight


@_entry("fleetwise's own tensor-parallel styles (strategy.mp_degree > 1)")
def tensor_parallel_style() -> type:
    """The base of a tensor-parallel style of fleetwise's own: a torch ParallelStyle written as one
    public method, `apply(module, device_mesh)`. `parallelize_module` calls a style's private
    `_apply`, its only extension point. Built on first use: importing
    torch's tensor-parallel package is a cost a job without mp does not pay."""
    global _STYLE
    if _STYLE is None:
        from torch.distributed.tensor.parallel import ParallelStyle

        class Style(ParallelStyle):
            def apply(self, module: nn.Module, device_mesh) -> nn.Module:
                raise NotImplementedError

            def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
                return self.apply(module, device_mesh)

        _STYLE = Style
    return _STYLE


_STYLE: type | None = None


@_entry("a DTensor shard's rows (ZeRO-1 and the vocabulary-parallel embedding)")
def local_rows(t) -> tuple[int, int]:
    """(rows, first row) of this rank's shard of a DTensor sharded on dim 0 (torch's own split,
    uneven shards included)."""
    (rows, *_), (start, *_) = local_box(t)
    return rows, start


@_entry("a DTensor shard's place in the whole tensor (reading a Hugging Face checkpoint's slices)")
def local_box(t) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset in the global tensor) of this rank's shard of a DTensor: the box of the whole
    tensor it holds (TP and FSDP shards, FSDP over TP's strided shards included: what DCP writes)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)


@_entry("resolving a process group by name")
def resolve_process_group(name: str):
    """The process group registered under `name` (how c10d ops name their group)."""
    return dist.distributed_c10d._resolve_process_group(name)


@_entry("flattened device-mesh dimensions (FSDP and ZeRO over several dimensions)")
def flatten_mesh(mesh, dims: tuple[str, ...]):
    """One mesh dimension made of several (`mesh[dims]` flattened, named "a_b"): DeviceMesh has no
    public way to do it yet (the same signature on every version in TESTED)."""
    return mesh[dims]._flatten("_".join(dims))


# ------------------------------------------------------------------------------------------------
# torchrun's elastic agent (launcher/agent.py, a process that imports torch anyway).


@_entry("the elastic agent's rendezvous hook (launcher/agent.py)")
def after_each_rendezvous(hook: Callable[[Any], None]) -> None:
    """Call `hook(worker_group)` after the elastic agent's every rendezvous, before its workers
    start (`SimpleElasticAgent._rendezvous(self, worker_group)`), in this process."""
    from torch.distributed.elastic.agent.server import api

    rendezvous = api.SimpleElasticAgent._rendezvous

    def _rendezvous(self, worker_group):
        rendezvous(self, worker_group)
        hook(worker_group)

    api.SimpleElasticAgent._rendezvous = _rendezvous


@_entry("starting the ranks as a function (launcher/agent.py)")
def launch_ranks_with(transform: Callable[[Any, Any, list], tuple[Callable, tuple]]) -> None:
    """Let `transform(config, entrypoint, args) -> (function, args)` turn the command torchrun's
    main (`torch.distributed.run`) would start as each worker into a function it starts instead
    (torch's multiprocessing start; the transform sets `config.start_method`)."""
    from torch.distributed import run

    launch = run.elastic_launch

    def elastic_launch(config, entrypoint):
        def start(*args):
            fn, fn_args = transform(config, entrypoint, list(args))
            return launch(config=config, entrypoint=fn)(*fn_args)

        return start

    run.elastic_launch = elastic_launch


@_entry("every failed rank in a failed group's report (launcher/agent.py)")
def report_every_failed_worker() -> None:
    """A group of workers started as a function reports its first failed process only (torch's
    `MultiprocessContext._poll`), where one started as a command reports every process that has
    failed: often a peer's "connection closed", seen before the rank that died and caused it.
    Add every other worker that has exited with an error (its exit code, its error file) to the
    report, as the command form does; launcher/failure.py then picks the cause among them."""
    from torch.distributed.elastic.multiprocessing import api

    poll = api.MultiprocessContext._poll

    def _poll(self):
        result = poll(self)
        if result is None or not result.failures:
            return result
        for local_rank, proc in enumerate(self._pc.processes):
            if local_rank not in result.failures and proc.exitcode not in (None, 0):
                result.failures[local_rank] = api.ProcessFailure(
                    local_rank=local_rank, pid=proc.pid, exitcode=proc.exitcode,
                    error_file=_readable_error_file(self.error_files[local_rank]),
                )  # fmt: skip
        return result

    api.MultiprocessContext._poll = _poll


def _readable_error_file(path: str) -> str:
    """`path` if it holds a whole JSON error record, else "" (no error file): torch terminates a
    failed group's other ranks as its report is made, and a rank killed while writing its error
    file leaves it half-written -- ProcessFailure then raised JSONDecodeError inside the agent's
    monitoring loop, which crashed the agent instead of restarting the group (seen once in a suite
    run: test_a_crashed_rank_is_restarted_and_finishes_like_an_uninterrupted_run[exit])."""
    import json

    try:
        with open(path) as f:
            json.load(f)
    except FileNotFoundError:
        return path  # (torch's own handling: reported without an error record)
    except (OSError, ValueError):
        return ""
    return path


@_entry("the rendezvous round (launcher/agent.py)")
def rendezvous_round(worker_group) -> int:
    """The round of the rendezvous `worker_group` was formed in (the dynamic rendezvous handler's
    state), 0 where the handler keeps none."""
    state = getattr(getattr(worker_group.spec.rdzv_handler, "_state_holder", None), "state", None)
    return int(getattr(state, "round", 0))


# ------------------------------------------------------------------------------------------------
# Distributed checkpoints.


@_entry("reading a checkpoint's metadata")
def metadata_path(reader, rank: int | None):
    """The path of a FileSystemReader's `.metadata` file for `rank`."""
    return reader._get_metadata_path(rank)


@_entry("loading a whole checkpoint in one process (checkpoint export)")
def load_into_empty(state: dict[str, Any], reader) -> None:
    """Load a whole checkpoint into the empty dict `state` in this one process (no process group):
    what torch's own `dcp_to_torch_save` does, with the reader given."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)


# ------------------------------------------------------------------------------------------------
# Pipelining: the receive buffers of a stage (runtime/pipeline_stage.py pools them).
#
# torch builds one set of receive buffers per micro-batch when a schedule first runs, in private
# methods that differ between versions (two shapes, named after their methods):
#   "setup" (torch 2.12, 2.13, 2.14): `_setup_forward_recv_info(n, has_backward)` and
#         `_setup_backward_recv_info(n)`; `_RecvInfo(name, source, buffer, tensor_meta, is_root_arg=)`,
#         `_make_tensor_from_meta(TensorMeta, device)`; a received activation's requires_grad is set
#         when it is read.
#   "prepare" (torch 2.11): `_prepare_forward_infra(n, args, kwargs)` (shape inference, then the
#         buffers, then the send info) and `_prepare_backward_infra(n)`; `_RecvInfo(name, source, buffer)`,
#         `_make_tensor_from_meta(meta tensor, device)`; buffers are made requires_grad up front.
#         Its P2P warm-up (`_get_init_p2p_neighbors_ops`) also links a stage to a neighbour on the
#         same rank, which gloo refuses: PooledRecvStage drops those ops (ZBV zero bubble).
# `PooledRecvStage` overrides whichever the installed torch has (found by name and signature, so
# an unchecked version with one of the two shapes takes it); with neither, `pooled_recv_stage()`
# is None and the runtime uses torch's own PipelineStage (runtime/pipeline_stage.py, with a note).
RECV_POOL_CHECKED = TESTED


def recv_api() -> str | None:
    """Which of the two shapes above the installed torch has ("setup" or "prepare"), or None."""
    from torch.distributed.pipelining.stage import PipelineStage

    def params(name: str) -> list[str]:
        return list(inspect.signature(getattr(PipelineStage, name)).parameters)[1:]

    if hasattr(PipelineStage, "_setup_forward_recv_info") and hasattr(
        PipelineStage, "_setup_backward_recv_info"
    ):
        return "setup" if params("_setup_forward_recv_info") == ["num_microbatches", "has_backward"] else None
    if hasattr(PipelineStage, "_prepare_forward_infra") and hasattr(PipelineStage, "_create_grad_recv_info"):
        return (
            "prepare" if params("_prepare_forward_infra") == ["num_microbatches", "args", "kwargs"] else None
        )
    return None


@functools.cache
def pooled_recv_stage() -> type | None:
    """`PooledRecvStage` for the installed torch, or None where torch has neither shape above. Made
    on first use: importing torch.distributed.pipelining takes seconds, and only pipelines need it.

    PooledRecvStage is torch's PipelineStage whose receive-buffer sets (`args_recv_info`,
    `grad_recv_info`: micro-batch -> tuple of receive infos) are dicts the subclass makes, through
    two hooks:

        pool_activations(first, make) -> dict   first: the one set torch made; make(): a new set
        pool_gradients(make) -> dict            make(): a new set of gradient buffers

    The first stage (nothing received forward) and the last (nothing backward) keep torch's own."""
    api = recv_api()
    if api is None:
        return None
    from torch.distributed.pipelining.stage import PipelineStage, _make_tensor_from_meta, _RecvInfo

    class PooledRecvStage(PipelineStage):
        def pool_activations(self, first: tuple, make: Callable[[], tuple]) -> dict:
            raise NotImplementedError

        def pool_gradients(self, make: Callable[[], tuple]) -> dict:
            raise NotImplementedError

        def _pool_forward(self, first: tuple) -> None:
            # what `get_bwd_send_ops` reads (sources, not buffers), so it never takes a set of its own
            if api == "setup":
                self._recv_template = tuple(
                    _RecvInfo(i.input_name, i.source, None, i.tensor_meta, is_root_arg=i.is_root_arg)
                    for i in first
                )
            else:
                self._recv_template = tuple(_RecvInfo(i.input_name, i.source, None) for i in first)
            self.args_recv_info = self.pool_activations(first, self._new_activation_set)

        def _new_activation_set(self) -> tuple:
            if api == "setup":
                return tuple(
                    _RecvInfo(
                        t.input_name,
                        t.source,
                        _make_tensor_from_meta(t.tensor_meta, self.device),
                        t.tensor_meta,
                    )
                    for t in self._recv_template
                )
            infos = tuple(
                _RecvInfo(t.input_name, t.source, _make_tensor_from_meta(meta, self.device))
                for t, meta in zip(self._recv_template, self.inputs_meta, strict=True)
            )
            if self.has_backward:  # as torch 2.11 makes its own
                for info in infos:
                    info.buffer.requires_grad_(True)
            return infos

        def _pool_backward(self, num_microbatches: int) -> None:
            self.chunks = num_microbatches  # what torch's own setup records
            self.grad_recv_info = self.pool_gradients(lambda: self._create_grad_recv_info(self.act_send_info))

        if api == "setup":

            def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
                if self.is_first:  # root inputs: nothing is received
                    super()._setup_forward_recv_info(num_microbatches, has_backward)
                    return
                super()._setup_forward_recv_info(1, has_backward)  # validates; one set, the template
                self._pool_forward(self.args_recv_info[0])

            def _setup_backward_recv_info(self, num_microbatches: int) -> None:
                if self.is_last:  # nothing is received: keep torch's (empty) entries
                    super()._setup_backward_recv_info(num_microbatches)
                    return
                self._pool_backward(num_microbatches)

        else:

            def _prepare_forward_infra(self, num_microbatches: int, args, kwargs=None):
                if self.is_first:
                    return super()._prepare_forward_infra(num_microbatches, args, kwargs)
                out = super()._prepare_forward_infra(1, args, kwargs)  # shape inference; one set
                self._pool_forward(self.args_recv_info[0])
                return out

            def _prepare_backward_infra(self, num_microbatches: int) -> None:
                if self.is_last:
                    super()._prepare_backward_infra(num_microbatches)
                    return
                self._pool_backward(num_microbatches)

            def _get_init_p2p_neighbors_ops(self) -> list:
                # torch 2.11 warms up the link to a neighbour stage on this same rank too (the V
                # schedules: stages 1 and 2 of pp 2), and gloo cannot send to itself ("Pair is not
                # connected"); same-rank stages pass tensors by function call, and torch 2.13 no
                # longer makes these ops. Dropped here, in pairs (a send and its receive).
                return [
                    op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank
                ]

        def get_bwd_send_ops(self, bwd_chunk_id: int):
            if self.grad_send_info is None and not self.is_first and self.has_backward:
                self.grad_send_info = self._create_grad_send_info(self._recv_template)
            return super().get_bwd_send_ops(bwd_chunk_id)

    return PooledRecvStage


# ------------------------------------------------------------------------------------------------
# Each entry above and the torch versions it was checked on: read in that version's source, and
# run by `make test-torch` (scripts/test_torch.py: the unit tests of `make check`, a real job of
# each engine, three dry runs). Where a version's internals differ, the entry finds the version's
# shape by name (the pipeline receive buffers, the collectives), not by version number.
CHECKED: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        (
            "TorchDispatchMode", "dispatch_modes", "modes_disabled", "tree_flatten", "FakeTensorMode",
            "is_fake", "storage_key", "local_tensor", "foreach_norm", "foreach_mul_", "foreach_copy_",
            "SCALAR_READ", "AMP_UNSCALE", "SDPA_CPU", "SDPA_CPU_BACKWARD", "SDPA_KERNELS",
            "FUNCTIONAL_REDUCE_SCATTER", "FUNCTIONAL_ALL_REDUCE", "BATCH_NORMS", "checkpoint_wrapper",
            "scaler_found_inf", "set_last_lr", "compile_counters", "quiet_redistribute_logs",
            "resolve_process_group", "flatten_mesh", "after_each_rendezvous", "launch_ranks_with",
            "report_every_failed_worker", "rendezvous_round",
            "metadata_path", "load_into_empty", "stage_backward_split", "tensor_parallel_style", "local_rows",
            "local_box", "ddp_ignore", "all_to_all_autograd",
        ),
        TESTED,
    ),
    # torch's own on 2.13, 2.14; the public reduce_scatter_tensor / all_gather_into_tensor on 2.11, 2.12
    "reduce_scatter_single": TESTED,
    "all_gather_single": TESTED,
    "pooled_recv_stage": RECV_POOL_CHECKED,
    "in_backward": TESTED,  # (torch.utils.checkpoint's own test for a recompute, on every version)
    **dict.fromkeys(("GROUPED_MM", "grouped_mm_supported", "grouped_mm"), _GROUPED_MM_VERSIONS),
}  # fmt: skip
