"""Host-cost probes: what a training step spends on the host beyond its GEMMs (per-op dispatch,
elementwise ops, gradient accumulation, convolution set-up, the optimizer update, checkpointing
machinery) and how much slower that work gets when every rank of a node runs it at once."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from fleetwise.calibrate.probes.compute import gemm_curve
from fleetwise.calibrate.probes.pipeline import zero_bubble_split_cost
from fleetwise.calibrate.probes.timing import interleaved, slowest, timed
from fleetwise.calibrate.probes.workloads import Chain, OpCounter


def op_overhead_us(layers: int = 16, width: int = 16, reps: int = 50) -> float:
    """Seconds per forward aten op of a tiny pre-LN MLP chain, forward + backward (microseconds)."""
    torch.manual_seed(0)
    chain, x = Chain(layers, width), torch.randn(2, 8, width)
    with torch.no_grad(), OpCounter() as counter:
        chain(x)
    t = timed(lambda: chain(x).backward(), reps, typical=True)
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
    t = timed(lambda: forward().backward(), reps, typical=True)
    return max(0.0, t - counter.count * overhead_us * 1e-6) / counter.elements * 1e9


def grad_accumulate_ns(device: torch.device | None = None, elements: int = 1 << 22, reps: int = 15) -> float:
    """Nanoseconds per element of adding a micro-batch's fp32 gradient into the step's in place
    (what gradient accumulation does once per micro-batch and parameter): median of `reps`."""
    device = device or torch.device("cpu")
    acc, grad = torch.zeros(elements, device=device), torch.randn(elements, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    return timed(lambda: acc.add_(grad), reps, sync, typical=True) / elements * 1e9


def conv_call_us(overhead_us: float, peak: float, reps: int = 50) -> float:
    """Host time of one small convolution's forward and backward beyond its FLOPs at peak and the
    per-op overhead: the set-up (oneDNN primitives, layout reorders) every conv call pays."""
    conv = torch.nn.Conv2d(16, 16, 3, padding=1, bias=False)
    x = torch.randn(2, 16, 8, 8, requires_grad=True)
    grad = torch.randn(2, 16, 8, 8)  # a dense incoming gradient, as a BatchNorm's backward gives
    flops = 3 * 2 * 9 * 16 * 16 * 8 * 8 * 2  # forward + 2 backward GEMM-equivalents
    t = timed(lambda: conv(x).backward(grad), reps, typical=True)
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
    t_small, t_large = interleaved([stepper(*small), stepper(*large)], reps)
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

    def chain(mode: str) -> Chain:
        torch.manual_seed(0)
        model = Chain(blocks, width, lambda w: PreLNBlock(w, 2, 4 * w))
        if mode != "none":
            apply_recompute(model, mode)
        return model

    x = torch.randn(2, 8, width)
    plain = chain("none")
    with OpCounter() as ops:  # with autograd on, as the planner's per-unit op counts are
        plain.layers["0"](x)
    block_ops = blocks * ops.count
    full, selective = chain("full"), chain("selective")
    t_plain, *timed = interleaved([lambda m=m: m(x).backward() for m in (plain, full, selective)], reps)
    extra = [max(0.0, (t - t_plain) / block_ops * 1e6 - overhead_us) for t in timed]
    return extra[0], extra[1]


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
        chain, x = Chain(2, width, lambda w: PreLNBlock(w, 4, 4 * w)), torch.randn(1, tokens, width)
    else:
        chain, x = Chain(16, 64), torch.randn(4, 16, 64)

    def timed(everyone: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        if everyone or dist.get_rank() == 0:
            for _ in range(2):
                chain(x).backward()
        return slowest(time.perf_counter() - start)  # alone: rank 0's

    timed(True)
    ratios = []
    for i in range(reps):
        first = i % 2 == 0  # alone first on even repetitions, together first on odd ones
        a, b = timed(not first), timed(first)
        together, alone = (b, a) if first else (a, b)
        ratios.append(together / alone)
    return max(1.0, statistics.median(ratios))


def cpu_host_costs(peak: float) -> dict[str, Any]:
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
