"""GPU probes: the device's own costs, which the shipped GPU profiles set from published figures
(its GEMM curve, the kernel floor, memory-bound ops, the host link)."""

from __future__ import annotations

from typing import Any

import torch

from fleetwise.calibrate.probes.compute import gemm_flops, monotone
from fleetwise.calibrate.probes.host import grad_accumulate_ns
from fleetwise.calibrate.probes.timing import timed

GPU_CURVE_SIZES = (512, 1024, 2048, 4096, 8192)


def gpu_costs(device: torch.device, dtype: torch.dtype, peak: float) -> dict[str, Any]:
    """The GPU time model's keys measured on `device`: square GEMMs at the training dtype against
    its peak (the curve), the time of a chain of tiny kernels (the per-op floor: three kernels per
    forward op with its backward), an elementwise add over a large tensor (bytes over HBM, charged
    per element written in forward, backward included: x3) and a pinned host-to-device copy."""

    def sync():
        torch.cuda.synchronize(device)

    curve = monotone({str(2 * n**3): min(1.0, gemm_flops(n, device, dtype) / peak) for n in GPU_CURVE_SIZES})
    tiny = torch.zeros(8, device=device)
    chain = 200
    kernel_s = timed(lambda: [tiny.add_(1) for _ in range(chain)], 10, sync) / chain
    big = torch.zeros(1 << 26, device=device, dtype=dtype)
    other = torch.ones_like(big)
    elem_s = timed(lambda: torch.add(big, other, out=big), 10, sync) / big.numel()
    host = torch.empty(1 << 26, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    copy_s = timed(lambda: dev.copy_(host, non_blocking=True), 10, sync)
    return {
        "op_overhead_us": 3 * kernel_s * 1e6,
        "elementwise_ns": 3 * elem_s * 1e9,
        "grad_accumulate_ns": grad_accumulate_ns(device, elements=1 << 26, reps=10),
        "gemm_curve": curve,
        "host_link_gbps": host.numel() / copy_s / 1e9,
    }
