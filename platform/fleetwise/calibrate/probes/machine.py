"""`measure()`: every probe of `fleetwise calibrate`, in order, on this machine (moved from
launcher/calibrate.py; the probes themselves live beside it, grouped by what they measure, and
calibrate/registry.py names the one that measures each profile key).

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
- collective latency and bandwidth: all-reduce of a 4-byte tensor (latency) and of large buffers
  (bandwidth: nccl-tests' bus bandwidth, ring volume 2(n-1)/n of the buffer, less the latency):
  gloo on CPU between 2 processes at 16 MiB; NCCL on GPU between every GPU of the node at 16, 64
  and 256 MiB, the best of them (NVLink reaches its rate only past ~100 MiB; 2 GPUs at 16 MiB read
  a fraction of it); and the reduce-scatter and all-gather (ring volume (n-1)/n) that ZeRO-1 and
  FSDP run instead: gloo's are slower per byte than its all-reduce (a reduce-scatter costs a whole
  all-reduce or more), NCCL's are not;
- tensor-parallel overhead (CPU): the same tiny chain with column/row-parallel linears (DTensor) on
  those 2 processes against the plain chain, less its collectives' latency, per forward op; and
  FSDP2 (a unit per block) the same way, per unit pass and parameter tensor; and how much slower
  host work gets when both processes run it in lockstep than when one runs it alone.
- the link between nodes (`--nodes N --node-rank R --endpoint HOST:PORT`, the same command on
  every node, HOST being node 0's address): one process per node over the job's backend (NCCL on
  GPU 0 of each node, gloo on CPUs) on the interface of the route to HOST, all-reduce of 4 bytes
  (inter_node_latency_us) and of large buffers (inter_node_gbps).
On a GPU the GEMMs of each precision run on device 0; the profile keeps the part's datasheet peak
(calibrate/gpus.py) and the curve and matmul efficiency are fractions of it (the best GEMM measured
is kept beside it); the per-op overhead is not charged (kernels queue asynchronously behind the
GPU's work); the pinned host link is measured both ways (FSDP's CPU offload crosses it).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from fleetwise.calibrate.calibration import Calibration
from fleetwise.calibrate.gpus import reference_peaks
from fleetwise.calibrate.probes.collectives import allreduce_speed, inter_node_speed
from fleetwise.calibrate.probes.compute import GEMM_SIZES, gemm_curve, gemm_flops, training_gemm_flops
from fleetwise.calibrate.probes.gpu import gpu_costs
from fleetwise.calibrate.probes.host import cpu_host_costs


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def measure(*, comm: bool = True, link: dict[str, Any] | None = None) -> Calibration:
    """Measure this machine (CPU, or GPU 0 when CUDA is available); with `link` (inter_node_speed's
    nodes, node_rank, endpoint) first the link between the nodes, run on every node at once."""
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    inter = inter_node_speed(**link, backend=backend) if link else {}
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
        measured, name = dict(peak), torch.cuda.get_device_name(device) if cuda else ""
        if cuda:  # the datasheet's peak, which MFU is a fraction of (not the best GEMM of this run)
            peak, note = reference_peaks(name, measured)
            notes += [note] if note else []
        train = training_gemm_flops(device, dtypes[half])
        efficiency = min(1.0, train / peak[half])
        # on a GPU the host's costs hide behind the device's queue: what is measured there is the
        # device's own (its GEMM curve, kernel floor, memory-bound ops, host link), the keys the
        # shipped GPU profiles set from published figures
        host = gpu_costs(device, dtypes[half], peak[half]) if cuda else cpu_host_costs(peak["fp32"])
        torch.set_num_threads(1)
        single = gemm_flops(512, device, torch.float32) if not cuda else measured["fp32"]
        if not cuda and cores > 1:
            host["gemm_curve_one_thread"] = gemm_curve(peak["fp32"] / cores, host["op_overhead_us"])
    finally:
        torch.set_num_threads(threads)
    comm_speed = {"allreduce_latency_us": 0.0, "allreduce_gbps": 0.0}
    if comm and (not cuda or torch.cuda.device_count() >= 2):
        # every GPU of the node: the ring an 8-GPU collective runs is not that of 2 GPUs
        comm_speed = allreduce_speed(backend, world=torch.cuda.device_count() if cuda else 2)
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
        device_name=name,
        measured_peak_flops=measured if cuda else {},
        **host,
        **comm_speed,
        **inter,
    )
