"""GPU probes: the device's own costs, which the shipped GPU profiles set from published figures
(its GEMM curve, the kernel floor, memory-bound ops, the host link offload crosses)."""

from __future__ import annotations

from typing import Any

import torch

from fleetwise.calibrate.probes.compute import gemm_flops, monotone
from fleetwise.calibrate.probes.host import grad_accumulate_ns
from fleetwise.calibrate.probes.timing import timed

GPU_CURVE_SIZES = (512, 1024, 2048, 4096, 8192)
HOST_LINK_BYTES = 256 * 2**20  # far past the copy engines' set-up: the link's rate, not its latency


def gpu_costs(device: torch.device, dtype: torch.dtype, peak: float) -> dict[str, Any]:
    """The GPU time model's keys measured on `device`: square GEMMs at the training dtype against
    `peak` (the curve: the profile's peak, the datasheet's where the part is known, so the curve is
    the fraction of it a GEMM of each size reaches), the time of a chain of tiny kernels (the
    per-op floor: three kernels per forward op with its backward), an elementwise add over a large
    tensor (bytes over HBM, charged per element written in forward, backward included: x3) and the
    pinned host link both ways (`host_link`)."""

    def sync():
        torch.cuda.synchronize(device)

    curve = efficiency_curve({n: gemm_flops(n, device, dtype) for n in GPU_CURVE_SIZES}, peak)
    tiny = torch.zeros(8, device=device)
    chain = 200
    kernel_s = timed(lambda: [tiny.add_(1) for _ in range(chain)], 10, sync) / chain
    big = torch.zeros(1 << 26, device=device, dtype=dtype)
    other = torch.ones_like(big)
    elem_s = timed(lambda: torch.add(big, other, out=big), 10, sync) / big.numel()
    to_device, to_host = host_link(device)
    return {
        "op_overhead_us": 3 * kernel_s * 1e6,
        "elementwise_ns": 3 * elem_s * 1e9,
        "grad_accumulate_ns": grad_accumulate_ns(device, elements=1 << 26, reps=10),
        "gemm_curve": curve,
        "host_link_gbps": link_rate(to_device, to_host),
        "host_to_device_gbps": to_device,
        "device_to_host_gbps": to_host,
    }


def efficiency_curve(flops_by_size: dict[int, float], peak: float) -> dict[str, float]:
    """FLOPs of one square GEMM of each size -> the fraction of `peak` it reached (FLOP/s measured
    over the peak, at most 1), non-decreasing in size (compute.monotone)."""
    return monotone({str(2 * n**3): min(1.0, flops / peak) for n, flops in flops_by_size.items()})


def host_link(device: torch.device, nbytes: int = HOST_LINK_BYTES, reps: int = 5) -> tuple[float, float]:
    """GB/s of a pinned host -> device copy and of a device -> host copy into pinned memory (best
    of `reps`): what FSDP's CPU offload moves every step -- each parameter shard up before its
    all-gather, each gradient shard down after its reduce-scatter."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def sync():
        torch.cuda.synchronize(device)

    up = timed(lambda: dev.copy_(host, non_blocking=True), reps, sync)
    down = timed(lambda: host.copy_(dev, non_blocking=True), reps, sync)
    return nbytes / up / 1e9, nbytes / down / 1e9


def link_rate(to_device: float, to_host: float) -> float:
    """The one host-link rate the planner charges both directions with (plan/time.py
    offload_seconds: the parameter shards' bytes up plus the gradient shards' down, over
    host_link_gbps): the harmonic mean of the two, exact for equal bytes each way."""
    return 2 / (1 / to_device + 1 / to_host)
