"""GEMM probes: the peak (square GEMMs), a training-shaped GEMM through autograd, and the
efficiency curve by GEMM size the planner interpolates (matmul_efficiency, gemm_efficiency)."""

from __future__ import annotations

import torch

from fleetwise.calibrate.probes.timing import timed
from fleetwise.calibrate.probes.workloads import OpCounter

GEMM_SIZES = (256, 512, 1024, 2048)
CURVE_SIZES = (32, 64, 128, 256, 512, 1024)


def gemm_flops(size: int, device: torch.device, dtype: torch.dtype, reps: int = 10) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    inner = max(1, int(2e9 // (2 * size**3))) if device.type == "cpu" else 20
    t = timed(lambda: [a @ b for _ in range(inner)], reps, sync)
    return inner * 2 * size**3 / t


def training_gemm_flops(device: torch.device, dtype: torch.dtype, size: int = 1024, reps: int = 15) -> float:
    """A linear layer's forward and backward (3 GEMMs of size³) through autograd."""
    x = torch.randn(size, size, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(size, size, device=device, dtype=dtype, requires_grad=True)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def step():
        (x @ w).sum().backward()

    t = timed(step, reps, sync)
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

        t = timed(step, reps, typical=True) / inner
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
