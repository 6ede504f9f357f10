"""`Calibration`: what one run of the probes measured (the "measured" object of `calibrate --json`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
    inter_node_backend: str | None = None  # what measured the link: the job's backend (nccl on GPUs)
    # GPU: the part (torch.cuda.get_device_name), the best GEMM of each precision measured here
    # (peak_flops is the datasheet's where calibrate/gpus.py knows the part) and each direction of
    # the pinned host link (host_link_gbps: their harmonic mean)
    device_name: str = ""
    measured_peak_flops: dict[str, float] = field(default_factory=dict)
    host_to_device_gbps: float | None = None
    device_to_host_gbps: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
