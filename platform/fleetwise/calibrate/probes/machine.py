"""`fleetwise calibrate`: measure this machine and write a hardware profile the planner can use.

What is measured (all on the current machine, nothing looked up):
- peak fp32 matmul FLOP/s: the best of square GEMMs of a few sizes, every core busy (one process,
  all threads); on a CPU this is the whole machine, shared by its ranks (`shared_compute`), and
  also with one thread (what one rank of a one-rank-per-core job gets);
- GEMM efficiency by size: a square Linear's forward + backward (3 GEMMs) from 32 to 1024, less
  the per-op overhead of its ops, with all threads (a job of one rank) and with one thread (ranks
  that share the cores), as a fraction of the peak the rank's threads own: the GEMMs of small
  models run far below peak;
- matmul efficiency: a training-shaped GEMM (forward and both backward GEMMs through autograd,
  1024×1024 activations and weights) over that peak. These two are the best of many runs (a peak
  is what the hardware can do; on a shared machine noise only ever slows a run down);
- per-op overhead: wall time of forward + backward of a chain of tiny layers (norm, linear, GELU,
  residual add: the op mix of a transformer block, at a width where FLOPs are negligible) divided
  by the aten ops its forward dispatches. The planner charges it per forward op of each unit;
- gradient accumulation: an in-place fp32 add of 4M elements, per element (a micro-batch's
  gradient added into the step's);
- elementwise cost: forward + backward of a chain of norms, GELUs, adds and log-softmaxes on
  64×256 activations, less the per-op overhead, divided by the elements those ops write;
- convolution set-up: a small 3×3 convolution's forward + backward, less its FLOPs at peak and the
  per-op overhead (oneDNN's per-call cost, which dominates the convolutions of small images);
- activation checkpointing: a chain of fleetwise's transformer blocks with full and with selective
  checkpointing against the plain chain, per forward op, beyond re-running the forward;
- parameter update: gradient norm, clipping and an AdamW step (what the trainer does once per step)
  over many small tensors (the cost per tensor) and a few large ones (the cost per element).
  The efficiency curve and these three host costs are medians of many runs, not the best: the
  planner predicts a training step's median time, and a step meets the machine's noise too;
- collective latency and bandwidth: all-reduce between 2 processes (gloo on CPU, nccl on GPU) of a
  4-byte tensor (latency) and of 16 MiB (bandwidth, ring volume 2(n-1)/n of the buffer); and the
  reduce-scatter of 16 MiB and the all-gather into 16 MiB (ring volume (n-1)/n) that ZeRO-1 and FSDP
  run instead: gloo's are slower per byte than its all-reduce (a reduce-scatter costs a whole
  all-reduce or more), NCCL's are not;
- tensor-parallel overhead (CPU): the same tiny chain with column/row-parallel linears (DTensor) on
  those 2 processes against the plain chain, less its collectives' latency, per forward op; and
  FSDP2 (a unit per block) the same way, per unit pass and parameter tensor; and how much slower
  host work gets when both processes run it in lockstep than when one runs it alone.
- the link between nodes (`--nodes N --node-rank R --endpoint HOST:PORT`, the same command on
  every node, HOST being node 0's address): one process per node, gloo over the interface of the
  route to HOST, all-reduce of 4 bytes (inter_node_latency_us) and of 16 MiB (inter_node_gbps).
On a GPU the peak is bf16 (and fp32/TF32) on device 0, and the per-op overhead is not charged
(kernels queue asynchronously behind the GPU's work).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

GEMM_SIZES = (256, 512, 1024, 2048)
CURVE_SIZES = (32, 64, 128, 256, 512, 1024)
# the scalar host costs of a training step: Calibration fields and hardware profile keys alike
HOST_COSTS = (
    "op_overhead_us",
    "elementwise_ns",
    "grad_accumulate_ns",
    "update_us_per_tensor",
    "update_ns_per_param",
    "conv_call_us",
    "checkpoint_op_us",
    "selective_checkpoint_op_us",
    "zero_bubble_split_op_us",
    "zero_bubble_split_ns_per_param",
    "dtensor_op_us",
    "fsdp_us_per_tensor",
    "fsdp_ns_per_param",
    "pipeline_action_us",
    "pipeline_multi_action_us",
    "zero1_us_per_tensor",
    "zero1_step_us_per_tensor",
    "co_run_slowdown",
)
LATENCY_BYTES = 4
BANDWIDTH_BYTES = 16 * 2**20


@dataclass
class Calibration:
    device_type: str
    backend: str
    cores: int
    peak_flops: dict[str, float]  # precision -> FLOP/s of the whole device (CPU: machine)
    gemm_flops: dict[str, float]  # "size" -> fp32 FLOP/s (all threads)
    single_thread_flops: float
    matmul_efficiency: float
    op_overhead_us: float
    allreduce_latency_us: float
    allreduce_gbps: float
    memory_gib: float
    notes: list[str] = field(default_factory=list)
    # FLOPs of one GEMM -> fraction of peak: all threads (of the machine's peak), one thread (of
    # one core's share of it)
    gemm_curve: dict[str, float] = field(default_factory=dict)
    gemm_curve_one_thread: dict[str, float] = field(default_factory=dict)
    elementwise_ns: float = 0.0
    grad_accumulate_ns: float = 0.0
    update_us_per_tensor: float = 0.0
    update_ns_per_param: float = 0.0
    dtensor_op_us: float = 0.0
    fsdp_us_per_tensor: float = 0.0
    fsdp_ns_per_param: float = 0.0  # FSDP's buffer copies per element and collective
    pipeline_action_us: float = 0.0
    pipeline_multi_action_us: float = 0.0  # more per forward/backward action of the multi-stage schedules
    zero1_us_per_tensor: float = 0.0  # ZeRO-1's host work per parameter tensor and micro-batch
    zero1_step_us_per_tensor: float = 0.0  # ... and per parameter tensor and step
    co_run_slowdown: float = 1.0
    conv_call_us: float = 0.0
    checkpoint_op_us: float = 0.0
    selective_checkpoint_op_us: float = 0.0
    zero_bubble_split_op_us: float = 0.0
    zero_bubble_split_ns_per_param: float = 0.0
    has_bf16: bool | None = None  # native bf16 (None: a GPU is assumed to have it, a CPU not)
    host_link_gbps: float | None = None  # GPU: pinned host -> device copy bandwidth
    reduce_scatter_gbps: float | None = None  # ring volume (n-1)/n of the input, per direction
    all_gather_gbps: float | None = None  # ring volume (n-1)/n of the output
    inter_node_gbps: float | None = None  # all-reduce between nodes, one rank per node (--nodes N)
    inter_node_latency_us: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _timed(fn, reps: int, sync=lambda: None, typical: bool = False) -> float:
    """Fastest (or, `typical`, the median) of `reps` runs of `fn`, in seconds, after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    if typical:
        return statistics.median(times)
    return min(times)  # best of reps: on a shared machine noise only ever slows a run down


def _interleaved(fns, reps: int) -> list[float]:
    """Median seconds of each of `fns`, run in turn (a, b, a, b, ...) after one warm-up each: a probe
    that subtracts one timing from another (a variant against its plain twin) must see a shared
    machine's slow spells on both sides alike, or the difference measures the noise."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def gemm_flops(size: int, device: torch.device, dtype: torch.dtype, reps: int = 10) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    inner = max(1, int(2e9 // (2 * size**3))) if device.type == "cpu" else 20
    t = _timed(lambda: [a @ b for _ in range(inner)], reps, sync)
    return inner * 2 * size**3 / t


def training_gemm_flops(device: torch.device, dtype: torch.dtype, size: int = 1024, reps: int = 15) -> float:
    """A linear layer's forward and backward (3 GEMMs of size³) through autograd."""
    x = torch.randn(size, size, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(size, size, device=device, dtype=dtype, requires_grad=True)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def step():
        (x @ w).sum().backward()

    t = _timed(step, reps, sync)
    return 3 * 2 * size**3 / t


def gemm_curve(peak: float, overhead_us: float, reps: int = 7, budget: float = 3e8) -> dict[str, float]:
    """FLOPs of one forward GEMM -> the fraction of `peak` a training step gets from it, at the
    current thread count. Measured the way the planner charges a step: a square Linear's forward
    and both backward GEMMs (transposed operands, the bias gradient, autograd), less the per-op
    overhead the planner already charges for the ops its forward dispatches. Small GEMMs in a
    backward pass run far below what a bare `a @ b` of the same size reaches."""
    out = {}
    for n in CURVE_SIZES:
        lin = torch.nn.Linear(n, n)
        x = torch.randn(n, n, requires_grad=True)
        grad = torch.randn(n, n)
        with OpCounter() as ops:  # with autograd on, as the planner's per-unit op counts are
            lin(x)
        flops = 3 * 2 * n**3
        inner = max(1, int(budget // flops))

        def step(lin=lin, x=x, grad=grad, inner=inner):
            for _ in range(inner):
                lin(x).backward(grad)

        t = _timed(step, reps, typical=True) / inner
        compute = max(t - ops.count * overhead_us * 1e-6, flops / peak)
        out[str(2 * n**3)] = round(flops / compute / peak, 4)
    return monotone(out)


def monotone(curve: dict[str, float]) -> dict[str, float]:
    """The curve made non-decreasing in GEMM size (each point the best of itself and every smaller
    one). A larger GEMM runs the same blocked kernel over more tiles; a point below a smaller one's
    is a run that met the machine's noise, and the search ranks micro-batch sizes by it: two idle
    calibrations 20 minutes apart read 0.96 and 0.87 at 2e9 FLOPs, and with 0.87 the planner
    ranked a ~20M GPT's micro-batch 8 slowest of 2/4/8 where it measured fastest."""
    out, best = {}, 0.0
    for key in sorted(curve, key=float):
        best = max(best, curve[key])
        out[key] = best
    return out


GEMM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution", "linear", "matmul"})


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops a region dispatches: all of them (`count`), the matmul-like ones
    (`gemms`: linear, conv, attention; `convs` of them convolutions) and the elements the other
    non-view ops write (`elements`): the planner's per-unit fwd_ops, fwd_gemms, fwd_convs and
    fwd_elementwise count the same things."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.gemms = 0
        self.convs = 0
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += 1
        name = func._schema.name.split("::")[-1]
        if name in GEMM_OPS or name.startswith("_scaled_dot_product"):
            self.gemms += 1
            self.convs += name == "convolution"
        elif not func.is_view and name != "_unsafe_view":
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.elements += sum(o.numel() for o in outs if isinstance(o, torch.Tensor))
        return out


def op_overhead_us(layers: int = 16, width: int = 16, reps: int = 50) -> float:
    """Seconds per forward aten op of a tiny pre-LN MLP chain, forward + backward (microseconds)."""
    torch.manual_seed(0)
    chain, x = _Chain(layers, width), torch.randn(2, 8, width)
    with torch.no_grad(), OpCounter() as counter:
        chain(x)
    t = _timed(lambda: chain(x).backward(), reps, typical=True)
    return t / counter.count * 1e6


def elementwise_ns(overhead_us: float, tokens: int = 64, width: int = 256, reps: int = 30) -> float:
    """Nanoseconds per element written by a norm/activation/add/softmax chain, forward + backward,
    after the per-op overhead is taken out."""
    from torch import nn

    torch.manual_seed(0)
    norms = [nn.LayerNorm(width) for _ in range(4)]
    x = torch.randn(tokens, width, requires_grad=True)

    def forward():
        h = x
        for ln in norms:
            h = h + nn.functional.gelu(ln(h), approximate="tanh")
        return nn.functional.log_softmax(h, -1).sum()

    with torch.no_grad(), OpCounter() as counter:
        forward()
    t = _timed(lambda: forward().backward(), reps, typical=True)
    return max(0.0, t - counter.count * overhead_us * 1e-6) / counter.elements * 1e9


def grad_accumulate_ns(device: torch.device | None = None, elements: int = 1 << 22, reps: int = 15) -> float:
    """Nanoseconds per element of adding a micro-batch's fp32 gradient into the step's in place
    (what gradient accumulation does once per micro-batch and parameter): median of `reps`."""
    device = device or torch.device("cpu")
    acc, grad = torch.zeros(elements, device=device), torch.randn(elements, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    return _timed(lambda: acc.add_(grad), reps, sync, typical=True) / elements * 1e9


def conv_call_us(overhead_us: float, peak: float, reps: int = 50) -> float:
    """Host time of one small convolution's forward and backward beyond its FLOPs at peak and the
    per-op overhead: the set-up (oneDNN primitives, layout reorders) every conv call pays."""
    conv = torch.nn.Conv2d(16, 16, 3, padding=1, bias=False)
    x = torch.randn(2, 16, 8, 8, requires_grad=True)
    grad = torch.randn(2, 16, 8, 8)  # a dense incoming gradient, as a BatchNorm's backward gives
    flops = 3 * 2 * 9 * 16 * 16 * 8 * 8 * 2  # forward + 2 backward GEMM-equivalents
    t = _timed(lambda: conv(x).backward(grad), reps, typical=True)
    return max(0.0, t - flops / peak - overhead_us * 1e-6) * 1e6


def update_cost(reps: int = 15) -> tuple[float, float]:
    """(µs per parameter tensor, ns per parameter) of one optimizer step as the trainer runs it:
    global gradient norm, clipping, AdamW (torch's default implementation for CPU tensors)."""

    def stepper(tensors: int, size: int):
        params = [torch.nn.Parameter(torch.randn(size)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn(size)
        opt = torch.optim.AdamW(params, lr=1e-3)

        def step():
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            for p in params:
                p.grad.mul_(1.0 / (float(norm) + 1e-6))
            opt.step()

        return step

    small, large = (256, 16), (8, 2**17)
    t_small, t_large = _interleaved([stepper(*small), stepper(*large)], reps)
    # t = tensors·a + elements·b, solved from the two shapes
    elements = (small[0] * small[1], large[0] * large[1])
    b = max(
        0.0, (t_large - t_small * large[0] / small[0]) / (elements[1] - elements[0] * large[0] / small[0])
    )
    a = max(0.0, (t_small - elements[0] * b) / small[0])
    return a * 1e6, b * 1e9


def checkpoint_op_us(
    overhead_us: float, blocks: int = 8, width: int = 16, reps: int = 30
) -> tuple[float, float]:
    """(full, selective): extra host time per forward op of an activation-checkpointed transformer
    block (fleetwise's own PreLNBlock, at a width where FLOPs are negligible), forward + backward,
    beyond re-running its forward, which the planner charges as per-op overhead already. It is the
    checkpoint machinery: saved-tensor hooks and the recompute's bookkeeping, and for selective
    checkpointing the dispatch mode that applies the save/recompute policy to every op, twice."""
    from fleetwise.models.transformer import PreLNBlock
    from fleetwise.runtime.recompute import apply_recompute

    def chain(mode: str) -> _Chain:
        torch.manual_seed(0)
        model = _Chain(blocks, width, lambda w: PreLNBlock(w, 2, 4 * w))
        if mode != "none":
            apply_recompute(model, mode)
        return model

    x = torch.randn(2, 8, width)
    plain = chain("none")
    with OpCounter() as ops:  # with autograd on, as the planner's per-unit op counts are
        plain.layers["0"](x)
    block_ops = blocks * ops.count
    full, selective = chain("full"), chain("selective")
    t_plain, *timed = _interleaved([lambda m=m: m(x).backward() for m in (plain, full, selective)], reps)
    extra = [max(0.0, (t - t_plain) / block_ops * 1e6 - overhead_us) for t in timed]
    return extra[0], extra[1]


def zero_bubble_split_cost(overhead_us: float, reps: int = 15) -> tuple[float, float]:
    """(µs per forward op, ns per parameter): the extra time of a transformer block's backward
    (fleetwise's own PreLNBlock) when a zero-bubble schedule splits it, beyond one full backward.
    torch's split (pipelining._backward: an input-gradient pass that keeps the graph and the
    parameter groups' intermediates, then a weight-gradient pass per group, under one
    GraphExecGroup as runtime/pipeline_stage.py runs it) walks the graph twice -- a host cost per
    op, taken at a width where FLOPs are negligible -- and costs a memory-bound pass over the
    block's weights on top, taken from the same block at width 256 less its per-op part. A 6-layer
    d=512 GPT on 2 CPU ranks measured ~4 ms per block and micro-batch more under interleaved zero
    bubble than under 1F1B; one such block alone, 2.4-4.2 ms (d=256: 2.1, d=768: 6.2)."""
    from torch.distributed.pipelining._backward import (
        stage_backward,
        stage_backward_input,
        stage_backward_weight,
    )
    from torch.utils.checkpoint import GraphExecGroup

    from fleetwise.models.transformer import PreLNBlock

    def extra(blocks: int, width: int, tokens: int) -> tuple[float, int, int]:
        """Seconds the split adds, forward ops, parameters."""
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(PreLNBlock(width, 2, 4 * width) for _ in range(blocks)))
        x = torch.randn(2, tokens, width, requires_grad=True)
        grad = torch.randn(2, tokens, width)

        def full():
            stage_backward([model(x)], [grad], [x])

        def split():
            _, groups = stage_backward_input([model(x)], [grad], [x], model.parameters())
            with GraphExecGroup():
                stage_backward_weight(model.parameters(), groups)

        with OpCounter() as ops:  # with autograd on, as the planner's per-unit op counts are
            model[0](x)
        t_full, t_split = _interleaved([full, split], reps)
        return t_split - t_full, blocks * ops.count, sum(p.numel() for p in model.parameters())

    # a zero-bubble pipeline has two ranks or more: measured at the threads each of two ranks gets
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // 2))
    try:
        seconds, ops, _ = extra(8, 16, 8)
        per_op = max(0.0, seconds / ops)
        seconds, ops, params = extra(1, 512, 128)
        per_param = max(0.0, (seconds - ops * per_op) / params)
    finally:
        torch.set_num_threads(threads)
    return per_op * 1e6, per_param * 1e9


class _Block(torch.nn.Module):
    """A pre-LN MLP block: the op mix of a transformer block at a width where FLOPs are negligible."""

    def __init__(self, width: int):
        super().__init__()
        self.ln = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, width)
        self.fc2 = torch.nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(h)), approximate="tanh"))


class _Chain(torch.nn.Module):
    """`layers` blocks of `width` (made by `block`) in a row, summed: forward + backward of it is
    what the host-cost probes time."""

    def __init__(self, layers: int, width: int, block=_Block):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): block(width) for i in range(layers)})

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            h = block(h)
        return h.sum()


def dtensor_op_us(mesh, latency_s: float, layers: int = 8, width: int = 16, reps: int = 30) -> float:
    """Extra host time per forward op of a tensor-parallel (DTensor) module over the same plain one,
    forward + backward, after its collectives' latency is taken out: sharding propagation, the
    subclass dispatch and waiting for the peer. Run on every rank of a 2-rank `mesh`."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    plain, tp = _Chain(layers, width), _Chain(layers, width)
    plan = {f"layers.{i}.fc1": ColwiseParallel() for i in range(layers)}
    plan |= {f"layers.{i}.fc2": RowwiseParallel() for i in range(layers)}
    parallelize_module(tp, mesh, plan)
    x = torch.randn(2, 8, width)
    with torch.no_grad(), OpCounter() as counter:
        plain(x)
    t_plain, t_tp = _interleaved([lambda: plain(x).backward(), lambda: tp(x).backward()], reps)
    collectives = 2 * layers  # row-parallel output (forward), column-parallel input grad (backward)
    return max(0.0, t_tp - t_plain - collectives * latency_s) / counter.count * 1e6


def _fsdp_twins(mesh, layers: int, width: int) -> tuple[_Chain, _Chain]:
    """A plain chain and its twin with every block (and the root) fully sharded over `mesh`, kept
    gathered until the backward (ZeRO-2), as the FSDP probes compare them."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    plain, sharded = _Chain(layers, width), _Chain(layers, width)
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
    plain, sharded = _fsdp_twins(mesh, layers, width)
    x = torch.randn(2, 8, width)
    t_plain, t_sharded = _interleaved([lambda: plain(x).backward(), lambda: sharded(x).backward()], reps)
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

    plain, sharded = _fsdp_twins(mesh, layers, width)
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

    t_plain, t_sharded, t_comm = _interleaved(
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

    from fleetwise.config.run import OptimConfig, TrainConfig
    from fleetwise.runtime.optim import Optimizers, Zero1Optimizers

    torch.manual_seed(0)
    optim, train = OptimConfig(lr=1e-3), TrainConfig(global_batch_size=1, micro_batch_size=1, steps=reps)
    plain, sharded = _Chain(layers, width), _Chain(layers, width)
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

    p1, z1, p3, z3 = _interleaved(
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


def pipeline_action_us(
    latency_s: float, microbatches: int = 8, width: int = 16, reps: int = 10
) -> tuple[float, float]:
    """Host time per schedule action of torch.distributed.pipelining (a micro-batch's forward or
    backward on one stage, with its send or receive), beyond the stage's own compute and the P2P
    latency: (single-stage 1F1B's, and what the multi-stage schedules spend on top). Run on every
    rank: the ranks are the stages of a pipeline of tiny layers, one per chunk, whose compute is
    negligible, so a step's time is almost all per-action overhead. With equal forward and backward
    actions a 1F1B step lasts 2 (n + pp - 1) action slots, an interleaved 1F1B one with v chunks per
    rank 2 (v n + pp - 1): the planner's actions / (1 - bubble). The multi-stage probe is interleaved
    1F1B with 2 chunks per rank (torch's PipelineScheduleMulti, which every interleaved and
    zero-bubble schedule runs on: 2 CPU ranks measured ~1.1 ms a slot there vs ~0.65 ms under 1F1B)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    x, target = torch.randn(2 * microbatches, width), torch.zeros(2 * microbatches, width)

    def layer() -> nn.Module:
        return nn.Sequential(nn.Linear(width, width), nn.Tanh())

    def timed_step(schedule) -> float:
        def step():
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=target, losses=[])
            else:
                schedule.step()
            dist.barrier()

        return _timed(step, reps, typical=True)

    def loss(out, _):
        return out.sum()

    torch.manual_seed(0)
    part = layer()
    single = Schedule1F1B(PipelineStage(part, rank, world, torch.device("cpu")), microbatches, loss_fn=loss)
    chunks = [PipelineStage(layer(), i, 2 * world, torch.device("cpu")) for i in (rank, rank + world)]
    multi = ScheduleInterleaved1F1B(chunks, microbatches, loss_fn=loss)
    micro = x[:2]
    t_local = _timed(lambda: part(micro).sum().backward(), reps * microbatches, typical=True)
    per_single = timed_step(single) / (2 * (microbatches + world - 1))
    per_multi = timed_step(multi) / (2 * (2 * microbatches + world - 1))
    base = max(0.0, per_single - t_local / 2 - latency_s)
    return base * 1e6, max(0.0, per_multi - per_single) * 1e6


def _slowest(seconds: float) -> float:
    """The largest of every rank's value: a collective step lasts as long as its slowest rank."""
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def co_run_slowdown(reps: int = 40, width: int = 128, tokens: int = 128) -> float:
    """How much slower a training step's work gets when every process of the job runs it at once, in
    lockstep (each iteration lasts as long as its slowest rank), than when rank 0 runs it alone:
    cores that share execution units, caches or memory bandwidth, the noise of a shared machine, and
    waiting for the slowest rank at every collective. Timed on two of fleetwise's own transformer
    blocks, forward and backward (GEMMs beside per-op host work, as a step mixes them; `width` 0: a
    host-bound chain of tiny layers), as the median of each repetition's together / alone ratio,
    the two back to back in alternating order, so that a slow spell of a shared machine lands on
    both sides of one ratio. Run on every rank; the same value comes back to all."""
    import torch.distributed as dist

    from fleetwise.models.transformer import PreLNBlock

    torch.manual_seed(0)
    if width:
        chain, x = _Chain(2, width, lambda w: PreLNBlock(w, 4, 4 * w)), torch.randn(1, tokens, width)
    else:
        chain, x = _Chain(16, 64), torch.randn(4, 16, 64)

    def timed(everyone: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        if everyone or dist.get_rank() == 0:
            for _ in range(2):
                chain(x).backward()
        return _slowest(time.perf_counter() - start)  # alone: rank 0's

    timed(True)
    ratios = []
    for i in range(reps):
        first = i % 2 == 0  # alone first on even repetitions, together first on odd ones
        a, b = timed(not first), timed(first)
        together, alone = (b, a) if first else (a, b)
        ratios.append(together / alone)
    return max(1.0, statistics.median(ratios))


def _allreduce_worker(rank: int, world: int, init_file: str, backend: str, out_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        # NCCL binds a communicator to the current device: without this every rank would use GPU 0
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    results = {}
    for nbytes, reps in ((LATENCY_BYTES, 200), (BANDWIDTH_BYTES, 10)):
        t = torch.ones(nbytes // 4, device=device)
        for _ in range(3):
            dist.all_reduce(t)
        sync()
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            sync()
            times.append(time.perf_counter() - start)
        # every rank's median; the slowest rank decides when the collective is done
        results[nbytes] = _slowest(statistics.median(times))
    results.update(_shard_collectives(world, rank, device, sync))
    if backend == "gloo":  # on GPUs DTensor's host work overlaps the kernels
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        results["dtensor_op_us"] = _slowest(dtensor_op_us(mesh, results[LATENCY_BYTES]))
        results["fsdp_us_per_tensor"] = _slowest(fsdp_us_per_tensor(mesh, results[LATENCY_BYTES]))
        results["fsdp_ns_per_param"] = _slowest(fsdp_ns_per_param(mesh, results["fsdp_us_per_tensor"]))
        results["co_run_slowdown"] = co_run_slowdown()
        single, multi = pipeline_action_us(results[LATENCY_BYTES])
        results["pipeline_action_us"], results["pipeline_multi_action_us"] = _slowest(single), _slowest(multi)
        zero_mesh = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("dp", "sharding", "mp"))
        hook, step = zero1_host_us(zero_mesh, results[LATENCY_BYTES])
        results["zero1_us_per_tensor"], results["zero1_step_us_per_tensor"] = _slowest(hook), _slowest(step)
    if rank == 0:
        Path(out_file).write_text(repr(results))
    dist.destroy_process_group()
    from fleetwise.runtime.mesh import exit_finished

    exit_finished()  # the probes' meshes keep process groups alive past destroy_process_group


def _shard_collectives(world: int, rank: int, device, sync, reps: int = 10) -> dict[str, float]:
    """Seconds (median, slowest rank) of a reduce-scatter of BANDWIDTH_BYTES and of an all-gather
    into BANDWIDTH_BYTES, the collectives of ZeRO-1 and FSDP, keyed "reduce_scatter" / "all_gather"."""
    import torch.distributed as dist

    whole = torch.ones(BANDWIDTH_BYTES // 4, device=device)
    piece = torch.ones(BANDWIDTH_BYTES // 4 // world, device=device)
    ops = {
        "reduce_scatter": lambda: dist.reduce_scatter_single(piece, whole),
        "all_gather": lambda: dist.all_gather_single(whole, piece),
    }
    out = {}
    for name, op in ops.items():
        op()
        sync()
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            op()
            sync()
            times.append(time.perf_counter() - start)
        out[name] = _slowest(statistics.median(times))
    return out


def allreduce_speed(backend: str, world: int = 2) -> dict[str, float]:
    """Latency (µs) and bandwidth (GB/s per direction) of an all-reduce between `world` processes,
    and (gloo only) the extra µs per forward op of a tensor-parallel module between them, per FSDP
    unit pass and parameter tensor, and the slowdown of host work run by all of them at once;
    keyed by Calibration's field names."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fleetwise-calibrate-") as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out")
        mp.spawn(_allreduce_worker, args=(world, init_file, backend, out_file), nprocs=world, join=True)
        results = eval(Path(out_file).read_text())  # noqa: S307 - a dict of floats we wrote ourselves
    latency = results[LATENCY_BYTES]
    moved = 2 * (world - 1) / world * BANDWIDTH_BYTES  # bytes each rank sends in a ring all-reduce
    bandwidth = moved / max(results[BANDWIDTH_BYTES] - latency, 1e-9)
    # reduce-scatter and all-gather: ring volume (n-1)/n of the whole buffer, the planner's convention
    shard = {
        f"{name}_gbps": (world - 1) / world * BANDWIDTH_BYTES / max(results.pop(name) - latency, 1e-9) / 1e9
        for name in ("reduce_scatter", "all_gather")
    }
    probes = {k: v for k, v in results.items() if isinstance(k, str)}  # gloo: the DTensor/FSDP/co-run probes
    return {"allreduce_latency_us": latency * 1e6, "allreduce_gbps": bandwidth / 1e9, **shard, **probes}


def inter_node_speed(nodes: int, node_rank: int, endpoint: str, timeout_s: float = 300.0) -> dict[str, float]:
    """Latency (µs) and bandwidth (GB/s per direction) of a gloo all-reduce between `nodes`
    machines, this process being node `node_rank`'s one rank; they meet at `endpoint` HOST:PORT,
    where node 0 hosts the store. gloo uses the interface of the kernel's route to HOST (as
    `fleetwise train` does) unless GLOO_SOCKET_IFNAME is set. Keyed by Calibration's field names."""
    from datetime import timedelta

    import torch.distributed as dist

    from fleetwise.launcher.hostnet import interface_env, node_network

    net = node_network(endpoint)
    os.environ.update(interface_env(net, os.environ))
    host, _, port = endpoint.rpartition(":")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        host.strip("[]"), int(port), nodes, is_master=node_rank == 0, timeout=timeout, wait_for_workers=False
    )
    dist.init_process_group("gloo", store=store, rank=node_rank, world_size=nodes, timeout=timeout)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = {}
        for nbytes, reps in ((LATENCY_BYTES, 100), (BANDWIDTH_BYTES, 8)):
            t = torch.ones(nbytes // 4)
            for _ in range(2):
                dist.all_reduce(t)
            times = []
            for _ in range(reps):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - start)
            results[nbytes] = _slowest(statistics.median(times))
        dist.barrier()
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()
    latency = results[LATENCY_BYTES]
    moved = 2 * (nodes - 1) / nodes * BANDWIDTH_BYTES
    bandwidth = moved / max(results[BANDWIDTH_BYTES] - latency, 1e-9)
    return {"inter_node_latency_us": latency * 1e6, "inter_node_gbps": bandwidth / 1e9}


def _cpu_host_costs(peak: float) -> dict[str, Any]:
    """The host costs the planner charges on a CPU (at the current thread count), keyed by
    Calibration's field names."""
    overhead = op_overhead_us()
    per_tensor, per_param = update_cost()
    checkpoint, selective = checkpoint_op_us(overhead)
    split_op, split_param = zero_bubble_split_cost(overhead)
    return {
        "op_overhead_us": overhead,
        "elementwise_ns": elementwise_ns(overhead),
        "grad_accumulate_ns": grad_accumulate_ns(),
        "update_us_per_tensor": per_tensor,
        "update_ns_per_param": per_param,
        "conv_call_us": conv_call_us(overhead, peak),
        "checkpoint_op_us": checkpoint,
        "selective_checkpoint_op_us": selective,
        "zero_bubble_split_op_us": split_op,
        "zero_bubble_split_ns_per_param": split_param,
        "gemm_curve": gemm_curve(peak, overhead),
    }


GPU_CURVE_SIZES = (512, 1024, 2048, 4096, 8192)


def _gpu_costs(device: torch.device, dtype: torch.dtype, peak: float) -> dict[str, Any]:
    """The GPU time model's keys measured on `device`: square GEMMs at the training dtype against
    its peak (the curve), the time of a chain of tiny kernels (the per-op floor: three kernels per
    forward op with its backward), an elementwise add over a large tensor (bytes over HBM, charged
    per element written in forward, backward included: x3) and a pinned host-to-device copy."""

    def sync():
        torch.cuda.synchronize(device)

    curve = monotone({str(2 * n**3): min(1.0, gemm_flops(n, device, dtype) / peak) for n in GPU_CURVE_SIZES})
    tiny = torch.zeros(8, device=device)
    chain = 200
    kernel_s = _timed(lambda: [tiny.add_(1) for _ in range(chain)], 10, sync) / chain
    big = torch.zeros(1 << 26, device=device, dtype=dtype)
    other = torch.ones_like(big)
    elem_s = _timed(lambda: torch.add(big, other, out=big), 10, sync) / big.numel()
    host = torch.empty(1 << 26, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    copy_s = _timed(lambda: dev.copy_(host, non_blocking=True), 10, sync)
    return {
        "op_overhead_us": 3 * kernel_s * 1e6,
        "elementwise_ns": 3 * elem_s * 1e9,
        "grad_accumulate_ns": grad_accumulate_ns(device, elements=1 << 26, reps=10),
        "gemm_curve": curve,
        "host_link_gbps": host.numel() / copy_s / 1e9,
    }


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def calibrate(*, comm: bool = True, link: dict[str, Any] | None = None) -> Calibration:
    """Measure this machine (CPU, or GPU 0 when CUDA is available); with `link` (inter_node_speed's
    nodes, node_rank, endpoint) first the link between the nodes, run on every node at once."""
    inter = inter_node_speed(**link) if link else {}
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    notes = []
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(cores)
    try:
        gemms = {str(n): gemm_flops(n, device, torch.float32) for n in GEMM_SIZES}
        peak = {"fp32": max(gemms.values())}
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = True
            peak["tf32"] = max(gemm_flops(n, device, torch.float32) for n in (4096, 8192))
            peak["fp16"] = max(gemm_flops(n, device, torch.float16) for n in (4096, 8192))
            # V100 runs bf16 emulated (far below its fp16 peak): it is no training precision there
            has_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
            if has_bf16:
                peak["bf16"] = max(gemm_flops(n, device, torch.bfloat16) for n in (4096, 8192))
            torch.backends.cuda.matmul.allow_tf32 = False
        half = ("bf16" if has_bf16 else "fp16") if cuda else "fp32"
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        train = training_gemm_flops(device, dtypes[half])
        efficiency = min(1.0, train / peak[half])
        # on a GPU the host's costs hide behind the device's queue: what is measured there is the
        # device's own (its GEMM curve, kernel floor, memory-bound ops, host link), the keys the
        # shipped GPU profiles set from published figures
        host = _gpu_costs(device, dtypes[half], peak[half]) if cuda else _cpu_host_costs(peak["fp32"])
        torch.set_num_threads(1)
        single = gemm_flops(512, device, torch.float32) if not cuda else peak["fp32"]
        if not cuda and cores > 1:
            host["gemm_curve_one_thread"] = gemm_curve(peak["fp32"] / cores, host["op_overhead_us"])
    finally:
        torch.set_num_threads(threads)
    comm_speed = {"allreduce_latency_us": 0.0, "allreduce_gbps": 0.0}
    backend = "nccl" if cuda else "gloo"
    if comm and (not cuda or torch.cuda.device_count() >= 2):
        comm_speed = allreduce_speed(backend)
    elif comm:
        notes.append("one GPU: collective latency and bandwidth not measured (profile keeps defaults)")
    return Calibration(
        device_type=device.type,
        backend=backend,
        cores=cores,
        peak_flops=peak,
        gemm_flops=gemms,
        single_thread_flops=single,
        matmul_efficiency=efficiency,
        memory_gib=_memory_gib(device),
        notes=notes,
        has_bf16=has_bf16 if cuda else False,
        **host,
        **comm_speed,
        **inter,
    )


def profile(cal: Calibration, name: str = "local") -> dict[str, Any]:
    """A hardware profile (the schema of conf/hardware/*.yaml) from a calibration.

    CPU: one rank per core by default (devices_per_node = cores), the measured machine peak shared
    by them (shared_compute), host memory split evenly. GPU: one device per GPU found."""
    cpu = cal.device_type == "cpu"
    devices = cal.cores if cpu else max(1, torch.cuda.device_count())
    tflops = {k: v / 1e12 for k, v in cal.peak_flops.items()}
    out: dict[str, Any] = {
        "name": name,
        "device_type": cal.device_type,
        "backend": cal.backend,
        "nodes": 1,
        "devices_per_node": devices,
        "memory_per_device_gib": round(cal.memory_gib * (0.8 / devices if cpu else 1.0), 2),
        "peak_tflops": {
            "fp32": round(tflops["fp32"], 6),
            "tf32": round(tflops["tf32"], 3) if "tf32" in tflops else None,
            "bf16": round(tflops["bf16"], 3) if "bf16" in tflops else None,
            "fp16": round(tflops["fp16"], 3) if "fp16" in tflops else None,
        },
        "has_bf16": (not cpu) if cal.has_bf16 is None else cal.has_bf16,
        # the measured capacity is what torch sees; a GPU still loses its CUDA context, NCCL buffers
        # and cuBLAS workspace (~1.6 GiB, see conf/hardware/h100.yaml) and ~5 % to fragmentation
        "device_overhead_gib": 0.0 if cpu else 1.6,
        "fragmentation": 0.0 if cpu else 0.05,
        "intra_node_gbps": round(cal.allreduce_gbps, 3) if cal.allreduce_gbps else (2.0 if cpu else 450.0),
        # measured by `fleetwise calibrate --nodes N ...` on every node; else 10 GbE / 400 Gb/s NDR
        "inter_node_gbps": round(cal.inter_node_gbps, 4) if cal.inter_node_gbps else (1.25 if cpu else 50.0),
        "inter_node_latency_us": round(cal.inter_node_latency_us, 1) if cal.inter_node_latency_us else None,
        "shared_compute": cpu,
        "host_cores": cal.cores if cpu else None,
        "matmul_efficiency": round(cal.matmul_efficiency, 4),
        "comm_latency_us": round(cal.allreduce_latency_us, 1) if cal.allreduce_latency_us else 20.0,
        # null (the all-reduce's bandwidth) where not measured
        "reduce_scatter_gbps": round(cal.reduce_scatter_gbps, 3) if cal.reduce_scatter_gbps else None,
        "all_gather_gbps": round(cal.all_gather_gbps, 3) if cal.all_gather_gbps else None,
        **{k: round(getattr(cal, k), 3) for k in HOST_COSTS},
    }
    if cal.host_link_gbps:
        out["host_link_gbps"] = round(cal.host_link_gbps, 2)
    if cal.gemm_curve:
        out["gemm_efficiency"] = [[float(f), e] for f, e in cal.gemm_curve.items()]
    if cal.gemm_curve_one_thread:
        out["gemm_efficiency_one_thread"] = [[float(f), e] for f, e in cal.gemm_curve_one_thread.items()]
    return out


def update_link(path: Path, speed: dict[str, float]) -> str:
    """A profile file's text with its inter-node keys set to a measurement (inter_node_speed's),
    the rest of the file (comments included) as it was."""
    import re

    text = path.read_text()
    for key, digits in (("inter_node_gbps", 4), ("inter_node_latency_us", 1)):
        line = f"{key}: {round(speed[key], digits)}  # measured by fleetwise calibrate --nodes"
        text, found = re.subn(rf"(?m)^{key}:.*$", line, text)
        if not found:
            text = text.rstrip("\n") + "\n" + line + "\n"
    return text


def profile_yaml(cal: Calibration, name: str = "local") -> str:
    import yaml

    gflops = ", ".join(f"{k}: {v / 1e9:.1f}" for k, v in cal.gemm_flops.items())
    header = (
        f"# Written by `fleetwise calibrate` on {time.strftime('%Y-%m-%d %H:%M')} ({cal.cores} cores, "
        f"torch {torch.__version__}).\n"
        f"# fp32 GEMM GFLOP/s by size (all threads): {gflops}; one thread: "
        f"{cal.single_thread_flops / 1e9:.1f}.\n"
        f"# all-reduce ({cal.backend}, 2 processes): latency {cal.allreduce_latency_us:.0f} us, "
        f"bandwidth {cal.allreduce_gbps:.2f} GB/s (reduce-scatter {cal.reduce_scatter_gbps or 0:.2f}, "
        f"all-gather {cal.all_gather_gbps or 0:.2f}). Select it with hardware={name}.\n"
    )
    if cal.inter_node_gbps:
        header += (
            f"# between nodes (gloo, one process per node): latency {cal.inter_node_latency_us:.0f} us, "
            f"bandwidth {cal.inter_node_gbps:.3f} GB/s.\n"
        )
    return header + yaml.safe_dump(profile(cal, name), sort_keys=False)
