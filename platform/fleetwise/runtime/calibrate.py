"""`fleetwise calibrate`: measure this machine and write a hardware profile the planner can use.

What is measured (all on the current machine, nothing looked up):
- peak fp32 matmul FLOP/s: the best of square GEMMs of a few sizes, every core busy (one process,
  all threads); on a CPU this is the whole machine, shared by its ranks (`shared_compute`), and
  also with one thread (what one rank of a one-rank-per-core job gets);
- matmul efficiency: a training-shaped GEMM (forward and both backward GEMMs through autograd,
  1024×1024 activations and weights) over that peak. Every timing is the best of many runs:
  on a shared machine noise only ever slows a run down;
- per-op overhead: wall time of forward + backward of a chain of tiny layers (norm, linear, GELU,
  residual add: the op mix of a transformer block, at a width where FLOPs are negligible) divided
  by the aten ops its forward dispatches. The planner charges it per forward op of each unit;
- collective latency and bandwidth: all-reduce between 2 processes (gloo on CPU, nccl on GPU) of a
  4-byte tensor (latency) and of 16 MiB (bandwidth, ring volume 2(n-1)/n of the buffer).
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _timed(fn, reps: int, sync=lambda: None) -> float:
    """Fastest of `reps` runs of `fn`, in seconds, after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)  # best of reps: on a shared machine noise only ever slows a run down


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


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def op_overhead_us(layers: int = 16, width: int = 16, reps: int = 50) -> float:
    """Seconds per forward aten op of a tiny pre-LN MLP chain, forward + backward (microseconds)."""
    from torch import nn

    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.ModuleDict(
            {"ln": nn.LayerNorm(width), "fc1": nn.Linear(width, width), "fc2": nn.Linear(width, width)}
        )
        for _ in range(layers)
    )
    x = torch.randn(2, 8, width)

    def forward():
        h = x
        for b in blocks:
            h = h + b["fc2"](nn.functional.gelu(b["fc1"](b["ln"](h)), approximate="tanh"))
        return h.sum()

    with torch.no_grad(), _CountOps() as counter:
        forward()
    t = _timed(lambda: forward().backward(), reps)
    return t / counter.count * 1e6


def _allreduce_worker(rank: int, world: int, init_file: str, backend: str, out_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
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
        med = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        results[nbytes] = float(med)
    if rank == 0:
        Path(out_file).write_text(repr(results))
    dist.destroy_process_group()


def allreduce_speed(backend: str, world: int = 2) -> tuple[float, float]:
    """(latency in µs, bandwidth in GB/s per direction) of an all-reduce between `world` processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fleetwise-calibrate-") as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out")
        mp.spawn(_allreduce_worker, args=(world, init_file, backend, out_file), nprocs=world, join=True)
        results = eval(Path(out_file).read_text())  # noqa: S307 - a dict of floats we wrote ourselves
    latency = results[LATENCY_BYTES]
    moved = 2 * (world - 1) / world * BANDWIDTH_BYTES  # bytes each rank sends in a ring all-reduce
    bandwidth = moved / max(results[BANDWIDTH_BYTES] - latency, 1e-9)
    return latency * 1e6, bandwidth / 1e9


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def calibrate(*, comm: bool = True) -> Calibration:
    """Measure this machine (CPU, or GPU 0 when CUDA is available)."""
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
            peak["bf16"] = max(gemm_flops(n, device, torch.bfloat16) for n in (4096, 8192))
            torch.backends.cuda.matmul.allow_tf32 = False
        train = training_gemm_flops(device, torch.bfloat16 if cuda else torch.float32)
        efficiency = min(1.0, train / (peak["bf16"] if cuda else peak["fp32"]))
        overhead = 0.0 if cuda else op_overhead_us()
        torch.set_num_threads(1)
        single = gemm_flops(512, device, torch.float32) if not cuda else peak["fp32"]
    finally:
        torch.set_num_threads(threads)
    latency, bandwidth = 0.0, 0.0
    backend = "nccl" if cuda else "gloo"
    if comm and (not cuda or torch.cuda.device_count() >= 2):
        latency, bandwidth = allreduce_speed(backend)
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
        op_overhead_us=overhead,
        allreduce_latency_us=latency,
        allreduce_gbps=bandwidth,
        memory_gib=_memory_gib(device),
        notes=notes,
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
            "fp16": round(tflops["bf16"], 3) if "bf16" in tflops else None,
        },
        "has_bf16": not cpu,
        "intra_node_gbps": round(cal.allreduce_gbps, 3) if cal.allreduce_gbps else (2.0 if cpu else 450.0),
        "inter_node_gbps": 1.25 if cpu else 50.0,  # not measurable from one machine: 10 GbE / 400 Gb/s NDR
        "shared_compute": cpu,
        "host_cores": cal.cores if cpu else None,
        "matmul_efficiency": round(cal.matmul_efficiency, 4),
        "comm_latency_us": round(cal.allreduce_latency_us, 1) if cal.allreduce_latency_us else 20.0,
        "op_overhead_us": round(cal.op_overhead_us, 2),
    }
    return out


def profile_yaml(cal: Calibration, name: str = "local") -> str:
    import yaml

    gflops = ", ".join(f"{k}: {v / 1e9:.1f}" for k, v in cal.gemm_flops.items())
    header = (
        f"# Written by `fleetwise calibrate` on {time.strftime('%Y-%m-%d %H:%M')} ({cal.cores} cores, "
        f"torch {torch.__version__}).\n"
        f"# fp32 GEMM GFLOP/s by size (all threads): {gflops}; one thread: "
        f"{cal.single_thread_flops / 1e9:.1f}.\n"
        f"# all-reduce ({cal.backend}, 2 processes): latency {cal.allreduce_latency_us:.0f} us, "
        f"bandwidth {cal.allreduce_gbps:.2f} GB/s. Select it with hardware={name}.\n"
    )
    return header + yaml.safe_dump(profile(cal, name), sort_keys=False)
