"""The profile writer: a hardware profile (conf/hardware/*.yaml's schema) from a Calibration."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleetwise.calibrate.calibration import Calibration
from fleetwise.calibrate.registry import ROWS, Constant

FIGURES = 4  # significant figures a measured value keeps: no run repeats closer than that


def significant(value: float, figures: int = FIGURES) -> float:
    """`value` to `figures` significant figures: a GPU's per-element cost of 0.0054 ns stays 0.0054
    (rounded to 3 decimals, as the writer did, it became 0.005: -7 %), a CPU's 210.4 µs stays 210.4."""
    if not value or not math.isfinite(value):
        return value
    return round(value, figures - 1 - math.floor(math.log10(abs(value))))


def _rounded(value: float | None) -> float | None:
    return significant(value) if value else None  # 0 or None: not measured


# How a row's value comes out of a Calibration where it is not the Calibration field of the same
# name to FIGURES significant figures; None: not measured, the registry's default for the device type.
MEASURED: dict[str, Callable[[Calibration], Any]] = {
    "intra_node_gbps": lambda cal: _rounded(cal.allreduce_gbps),
    # measured by `fleetwise calibrate --nodes N ...` on every node
    "inter_node_gbps": lambda cal: _rounded(cal.inter_node_gbps),
    "inter_node_latency_us": lambda cal: _rounded(cal.inter_node_latency_us),
    "matmul_efficiency": lambda cal: significant(cal.matmul_efficiency),
    "comm_latency_us": lambda cal: _rounded(cal.allreduce_latency_us),
    # null (the all-reduce's bandwidth) where not measured
    "reduce_scatter_gbps": lambda cal: _rounded(cal.reduce_scatter_gbps),
    "all_gather_gbps": lambda cal: _rounded(cal.all_gather_gbps),
    "host_link_gbps": lambda cal: _rounded(cal.host_link_gbps),
    "gemm_efficiency": lambda cal: [[float(f), significant(e)] for f, e in cal.gemm_curve.items()] or None,
    "gemm_efficiency_one_thread": lambda cal: (
        [[float(f), significant(e)] for f, e in cal.gemm_curve_one_thread.items()] or None
    ),
}


def _measured(cal: Calibration, row: Constant) -> Any:
    if row.field in MEASURED:
        value = MEASURED[row.field](cal)
    else:
        value = significant(getattr(cal, row.field)) if hasattr(cal, row.field) else None
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
            p: significant(tflops[p]) if p in tflops else None for p in ("fp32", "tf32", "bf16", "fp16")
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


def update_link(path: Path, speed: dict[str, float], backend: str = "gloo") -> str:
    """A profile file's text with its inter-node keys set to a measurement (inter_node_speed's, over
    `backend`), the rest of the file (comments included) as it was."""
    import re

    text = path.read_text()
    for key in ("inter_node_gbps", "inter_node_latency_us"):
        line = f"{key}: {significant(speed[key])}  # measured by fleetwise calibrate --nodes ({backend})"
        text, found = re.subn(rf"(?m)^{key}:.*$", line, text)
        if not found:
            text = text.rstrip("\n") + "\n" + line + "\n"
    return text


def _peaks_line(cal: Calibration) -> str:
    """What peak_tflops holds against what the GEMMs reached here, per precision."""
    measured = cal.measured_peak_flops or cal.peak_flops
    return "; ".join(
        f"{p} peak {cal.peak_flops[p] / 1e12:.4g} TFLOP/s, best GEMM measured {measured[p] / 1e12:.4g}"
        for p in ("fp32", "tf32", "bf16", "fp16")
        if p in cal.peak_flops and p in measured
    )


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
    if cal.device_name:
        header += f"# {cal.device_name}: {_peaks_line(cal)}.\n"
    if cal.host_to_device_gbps:
        header += (
            f"# host link (pinned copies): host->device {cal.host_to_device_gbps:.1f} GB/s, device->host "
            f"{cal.device_to_host_gbps or 0:.1f} GB/s; host_link_gbps is their harmonic mean.\n"
        )
    if cal.inter_node_gbps:
        header += (
            f"# between nodes ({cal.inter_node_backend}, one process per node): latency "
            f"{cal.inter_node_latency_us:.0f} us, bandwidth {cal.inter_node_gbps:.4g} GB/s.\n"
        )
    header += "".join(f"# note: {note}\n" for note in cal.notes)
    return header + yaml.safe_dump(profile(cal, name), sort_keys=False)
