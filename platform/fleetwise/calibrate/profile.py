"""The profile writer: a hardware profile (conf/hardware/*.yaml's schema) from a Calibration."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleetwise.calibrate.calibration import Calibration
from fleetwise.calibrate.registry import ROWS, Constant


def _rounded(value: float | None, digits: int) -> float | None:
    return round(value, digits) if value else None  # 0 or None: not measured


# How a row's value comes out of a Calibration where it is not the Calibration field of the same
# name rounded to 3 digits; None: not measured, the registry's default for the device type.
MEASURED: dict[str, Callable[[Calibration], Any]] = {
    "intra_node_gbps": lambda cal: _rounded(cal.allreduce_gbps, 3),
    # measured by `fleetwise calibrate --nodes N ...` on every node
    "inter_node_gbps": lambda cal: _rounded(cal.inter_node_gbps, 4),
    "inter_node_latency_us": lambda cal: _rounded(cal.inter_node_latency_us, 1),
    "matmul_efficiency": lambda cal: round(cal.matmul_efficiency, 4),
    "comm_latency_us": lambda cal: _rounded(cal.allreduce_latency_us, 1),
    # null (the all-reduce's bandwidth) where not measured
    "reduce_scatter_gbps": lambda cal: _rounded(cal.reduce_scatter_gbps, 3),
    "all_gather_gbps": lambda cal: _rounded(cal.all_gather_gbps, 3),
    "host_link_gbps": lambda cal: _rounded(cal.host_link_gbps, 2),
    "gemm_efficiency": lambda cal: [[float(f), e] for f, e in cal.gemm_curve.items()] or None,
    "gemm_efficiency_one_thread": lambda cal: (
        [[float(f), e] for f, e in cal.gemm_curve_one_thread.items()] or None
    ),
}


def _measured(cal: Calibration, row: Constant) -> Any:
    if row.field in MEASURED:
        value = MEASURED[row.field](cal)
    else:
        value = round(getattr(cal, row.field), 3) if hasattr(cal, row.field) else None
    return row.default_for(cal.device_type) if value is None else value


def profile(cal: Calibration, name: str = "local") -> dict[str, Any]:
    """A hardware profile (the schema of conf/hardware/*.yaml) from a calibration: what the machine
    is, then every registry row, measured or (not measured here) its default for the device type.

    CPU: one rank per core by default (devices_per_node = cores), the measured machine peak shared
    by them (shared_compute), host memory split evenly. GPU: one device per GPU found."""
    cpu = cal.device_type == "cpu"
    if cpu:
        devices = cal.cores
    else:
        import torch  # the probes that measured this GPU imported it already

        devices = max(1, torch.cuda.device_count())
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
        "shared_compute": cpu,
        "host_cores": cal.cores if cpu else None,
    }
    return out | {row.field: _measured(cal, row) for row in ROWS}


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
    import torch  # the probes imported it already
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
