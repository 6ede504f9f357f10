"""Where a job runs: the `hardware` config group (device, backend, counts, speeds, memory).

Two kinds of field. The DESCRIBED ones say what the machine is (device, counts, capacity, peak):
a profile sets them itself. Every other one is a constant of the planner's time model that
`fleetwise calibrate` measures, one row each in calibrate/registry.py (unit, defaults, probe,
planner term; tests/unit/calibrate/test_registry.py holds this schema to it). A profile that lacks
one (written by an older calibrate) gets its device type's default, and `defaulted` names it, so
that plan, validate and train say so; conf/hardware_keys.yaml makes every key overridable even
where the chosen profile lacks it.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from fleetwise.config.base import Section

GIB = 1024**3
# OmegaConf's mark of a value nothing set: conf/hardware_keys.yaml's, where a profile has no key
MISSING = "???"

# What a profile says the machine is: no default stands in for a missing one.
DESCRIBED = (
    "name",
    "device_type",
    "backend",
    "nodes",
    "devices_per_node",
    "memory_per_device_gib",
    "device_overhead_gib",
    "fragmentation",
    "peak_tflops",
    "has_bf16",
    "shared_compute",
    "host_cores",
)
# A calibrated constant's default on a GPU where it differs from the field's (a CPU's): host costs
# are 0 there (the host's work overlaps the kernels it queues; calibrate on a GPU writes 0), the
# others the shipped h100 profile's figures.
GPU_DEFAULTS: dict[str, Any] = {
    "intra_node_gbps": 450.0,
    "inter_node_gbps": 50.0,
    "op_overhead_us": 10.0,
    "elementwise_ns": 0.0054,
    "grad_accumulate_ns": 0.0036,
    "update_us_per_tensor": 0.0,
    "update_ns_per_param": 0.0,
    "conv_call_us": 0.0,
    "checkpoint_op_us": 0.0,
    "selective_checkpoint_op_us": 0.0,
    "zero_bubble_split_op_us": 0.0,
    "zero_bubble_split_ns_per_param": 0.0,
    "dtensor_op_us": 0.0,
    "fsdp_us_per_tensor": 0.0,
    "fsdp_ns_per_param": 0.0,
    "pipeline_action_us": 0.0,
    "pipeline_multi_action_us": 0.0,
    "zero1_us_per_tensor": 0.0,
    "zero1_step_us_per_tensor": 0.0,
    "co_run_slowdown": 1.0,
    "offload_update_ns_per_param": 1.0,
}


# Physically meaningful ranges by a figure's unit (the end of its name): the schema's own > 0 / >= 0
# let 1e-300 TFLOP/s plan a step of 1e290 s and 1e308 GiB overflow to infinity. Wide on purpose: from
# a slow CPU's worst to far beyond today's fastest device or link.
TFLOPS = (1e-6, 1e6, "TFLOP/s")  # 1 MFLOP/s .. 1 EFLOP/s per device
UNIT_BOUNDS: dict[str, tuple[float, float, str]] = {
    "_gib": (1e-6, 1e5, "GiB"),  # ~1 KiB .. ~100 TiB per device
    "_gbps": (1e-6, 1e6, "GB/s"),  # 1 kB/s .. 1 PB/s
    "_us": (0.0, 1e7, "us"),  # up to 10 s for one call or op
    "_us_per_tensor": (0.0, 1e7, "us"),
    "_ns": (0.0, 1e6, "ns"),  # up to 1 ms per element
    "_ns_per_param": (0.0, 1e6, "ns"),
}


def in_range(value: Any, bounds: tuple[float, float, str]) -> Any:
    """A figure outside its unit's meaningful range is refused with the unit and the bound (0 stays
    allowed where the schema allows it: a cost not charged)."""
    lo, hi, unit = bounds
    if isinstance(value, float | int) and (value > hi or 0 < value < lo):
        raise ValueError(
            f"{value:g} {unit} is outside the meaningful range {lo:g}..{hi:g} {unit}: give a value in it"
        )
    return value


class PeakTflops(Section):
    """Dense peak throughput of one device per dtype, in TFLOP/s (vendor datasheet, no sparsity)."""

    fp32: float = Field(gt=0, description="Plain fp32 FMA throughput.")
    tf32: float | None = Field(None, gt=0, description="TF32 tensor-core throughput (null: none).")
    bf16: float | None = Field(None, gt=0, description="bf16 throughput (null: no bf16 support).")
    fp16: float | None = Field(None, gt=0, description="fp16 throughput.")

    @field_validator("*")
    @classmethod
    def _in_range(cls, value: Any) -> Any:
        return in_range(value, TFLOPS)


class HardwareConfig(Section):
    name: str = Field(description="Profile name (cpu, v100, a100, h100, or a calibrated local profile).")
    device_type: Literal["cpu", "cuda"] = Field(description="torch device type of one rank.")
    backend: Literal["gloo", "nccl"] = Field(description="torch.distributed backend.")
    nodes: int = Field(1, ge=1, description="Machines in the job.")
    devices_per_node: int = Field(
        ge=1, description="Ranks per machine (GPUs, or processes on a CPU machine)."
    )
    memory_per_device_gib: float = Field(gt=0, description="Memory one rank may use, GiB.")
    device_overhead_gib: float = Field(
        0.0,
        ge=0,
        description="Memory of one device that training tensors never get: the gap between the nominal "
        "capacity and what the driver exposes, the CUDA context, NCCL's buffers and the cuBLAS workspace "
        "(GPU profiles document their estimate; 0 on CPUs).",
    )
    fragmentation: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Fraction of the capacity the caching allocator holds reserved but cannot hand out "
        "(fragmentation); the plan fits only below capacity - overhead - this share.",
    )
    peak_tflops: PeakTflops
    has_bf16: bool = Field(
        description="Whether bf16 arithmetic is native (V100: no; AVX2-only CPUs: emulated)."
    )
    intra_node_gbps: float = Field(
        2.0, gt=0, description="Per-device bandwidth inside a node, GB/s per direction."
    )
    inter_node_gbps: float = Field(
        1.25, gt=0, description="Per-device bandwidth between nodes, GB/s per direction."
    )
    shared_compute: bool = Field(
        False,
        description="peak_tflops is for the whole node and is shared by its ranks (CPU processes on common cores).",
    )
    matmul_efficiency: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Fraction of peak a large training matmul reaches (calibrate measures it).",
    )
    comm_latency_us: float = Field(
        20.0, ge=0, description="Fixed cost of one collective call, microseconds (calibrate measures it)."
    )
    inter_node_latency_us: float | None = Field(
        None,
        ge=0,
        description="Fixed cost of one collective call whose group spans nodes, microseconds (about a "
        "round trip between nodes, e.g. 1000 for a link with 0.5 ms each way; null: comm_latency_us).",
    )
    reduce_scatter_gbps: float | None = Field(
        None,
        gt=0,
        description="Bandwidth of a reduce-scatter, GB/s per direction on the ring volume ((n-1)/n of its "
        "input), where it differs from an all-reduce's (gloo's is a plain all-reduce's cost or more; "
        "calibrate measures it). null: intra_node_gbps (NCCL's ring reduce-scatter reaches all-reduce's "
        "bus bandwidth).",
    )
    all_gather_gbps: float | None = Field(
        None,
        gt=0,
        description="Bandwidth of an all-gather, GB/s per direction on the ring volume ((n-1)/n of its "
        "output), where it differs from an all-reduce's (calibrate measures it). null: intra_node_gbps.",
    )
    op_overhead_us: float = Field(
        12.0,
        ge=0,
        description="Host time per forward op (dispatch, autograd, Python) with its backward, microseconds "
        "(calibrate measures it; on a GPU the shortest time of its ~3 kernels, launch to end).",
    )
    gemm_efficiency: list[tuple[float, float]] | None = Field(
        None,
        description="Measured (FLOPs of one GEMM, fraction of peak) points, one rank on all cores: small "
        "GEMMs run far below peak. Unset: every GEMM at matmul_efficiency (calibrate measures it).",
    )
    gemm_efficiency_one_thread: list[tuple[float, float]] | None = Field(
        None,
        description="The same points for a one-thread rank (several ranks per CPU node), as a fraction "
        "of one core's share of the peak.",
    )
    elementwise_ns: float = Field(
        2.0,
        ge=0,
        description="Host time per element a non-matmul op (norm, activation, add, softmax) writes, "
        "forward with its backward, nanoseconds (calibrate measures it; on a GPU bytes over HBM bandwidth).",
    )
    grad_accumulate_ns: float = Field(
        1.2,
        ge=0,
        description="Time per gradient element added into a step's accumulated gradient (each micro-batch "
        "after the first into autograd's .grad under DDP, every micro-batch into ZeRO-1's fp32 buffer): "
        "an in-place fp32 add, memory-bound, nanoseconds (calibrate measures it; 0: not charged).",
    )
    update_us_per_tensor: float = Field(
        30.0,
        ge=0,
        description="Host time of the parameter update (gradient norm, clipping, AdamW) per parameter "
        "tensor, microseconds (calibrate measures it; 0: not charged).",
    )
    update_ns_per_param: float = Field(
        1.2, ge=0, description="The same update's time per parameter element, nanoseconds."
    )
    dtensor_op_us: float = Field(
        450.0,
        ge=0,
        description="Extra host time per forward op of a tensor-parallel (DTensor) module, with its "
        "backward, microseconds (calibrate measures it on CPUs; 0: not charged).",
    )
    fsdp_us_per_tensor: float = Field(
        550.0,
        ge=0,
        description="Extra host time of FSDP per unit, micro-batch (its forward and backward, with the "
        "unit's all-gather and reduce-scatter) and parameter tensor, microseconds (calibrate measures "
        "it on CPUs; 0: not charged).",
    )
    fsdp_ns_per_param: float = Field(
        3.0,
        ge=0,
        description="FSDP's copies into and out of its flat collective buffers, per parameter element of a "
        "unit and per all-gather or reduce-scatter of it, nanoseconds (calibrate measures it on CPUs; "
        "0: not charged).",
    )
    zero1_us_per_tensor: float = Field(
        17.0,
        ge=0,
        description="Extra host time of the ZeRO-1 engine per parameter tensor and micro-batch (its "
        "gradient hook, a Python call adding the fresh gradient into the fp32 buffer), microseconds "
        "(calibrate measures it on CPUs; 0: not charged, as on GPUs, where it overlaps the kernels).",
    )
    zero1_step_us_per_tensor: float = Field(
        30.0,
        ge=0,
        description="Extra host time of the ZeRO-1 engine per parameter tensor and optimizer step (the "
        "reduce's bookkeeping, the pieces' squared norms, the all-gather's copies in and out), "
        "microseconds (calibrate measures it on CPUs; 0: not charged).",
    )
    pipeline_action_us: float = Field(
        250.0,
        ge=0,
        description="Host time torch.distributed.pipelining spends per schedule action (one "
        "micro-batch's forward, backward or weight-gradient pass of one stage, with its send/receive) "
        "beyond the stage's compute and the P2P latency, microseconds (calibrate measures it on CPUs; "
        "0: not charged).",
    )
    pipeline_multi_action_us: float = Field(
        450.0,
        ge=0,
        description="Extra host time torch.distributed.pipelining's multi-stage schedules (interleaved "
        "1F1B, looped BFS, interleaved zero bubble, ZB-V) spend per forward and input-gradient action "
        "(those that send and receive) beyond pipeline_action_us, which 1F1B's single-stage schedule "
        "is measured on, microseconds (calibrate measures it on CPUs; 0: not charged).",
    )
    co_run_slowdown: float = Field(
        1.1,
        ge=1,
        description="How much slower a CPU rank's work gets when every core runs a rank in lockstep than "
        "when it runs alone (shared execution units, noise, waiting for the slowest; calibrate measures it).",
    )
    conv_call_us: float = Field(
        250.0,
        ge=0,
        description="Extra host time per convolution call, forward with its backward, microseconds "
        "(calibrate measures it on CPUs; 0: not charged).",
    )
    checkpoint_op_us: float = Field(
        10.0,
        ge=0,
        description="Extra host time per forward op of a fully checkpointed block beyond re-running it "
        "(saved-tensor hooks, recompute bookkeeping), microseconds (calibrate measures it on CPUs; 0: not charged).",
    )
    selective_checkpoint_op_us: float = Field(
        45.0,
        ge=0,
        description="The same for selective checkpointing, whose policy dispatch mode sees every op twice "
        "(calibrate measures it on CPUs; 0: not charged).",
    )
    zero_bubble_split_op_us: float = Field(
        38.0,
        ge=0,
        description="Extra host time per forward op of a block whose backward a zero-bubble schedule "
        "splits into input- and weight-gradient passes, beyond one full backward, microseconds "
        "(calibrate measures it on CPUs; 0: not charged).",
    )
    zero_bubble_split_ns_per_param: float = Field(
        0.44,
        ge=0,
        description="The same split's extra time per parameter of the block (a memory-bound pass over "
        "its weights), nanoseconds (calibrate measures it on CPUs; 0: not charged).",
    )
    host_link_gbps: float | None = Field(
        None,
        gt=0,
        description="Host <-> device bandwidth per device (PCIe), GB/s per direction: what offloaded "
        "parameters and gradients cross every step (null: offload is not charged).",
    )
    offload_update_ns_per_param: float = Field(
        0.0,
        ge=0,
        description="Host time of the optimizer step per offloaded parameter element (the update runs "
        "on the CPU), nanoseconds (0: not charged).",
    )
    host_cores: int | None = Field(
        None,
        ge=1,
        description="CPU cores the ranks of a node share (shared_compute); more ranks than cores time-share them.",
    )

    _defaulted: tuple[str, ...] = PrivateAttr(())

    @field_validator("*")
    @classmethod
    def _in_range(cls, value: Any, info: ValidationInfo) -> Any:
        suffix = next((u for u in UNIT_BOUNDS if (info.field_name or "").endswith(u)), None)
        return value if suffix is None else in_range(value, UNIT_BOUNDS[suffix])

    @model_validator(mode="wrap")
    @classmethod
    def _fill_calibrated(cls, data: Any, handler: Any) -> HardwareConfig:
        """A key the profile does not set (absent, or conf/hardware_keys.yaml's ???) is left out: a
        calibrated constant then takes its device type's default (the field's, or GPU_DEFAULTS on a
        GPU) and is named in `defaulted`; a DESCRIBED one its field's default, or "Field required"."""
        if not isinstance(data, dict):
            return handler(data)
        data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == MISSING)}
        missing = tuple(f for f in cls.model_fields if f not in DESCRIBED and f not in data)
        if data.get("device_type") == "cuda":
            data |= {f: GPU_DEFAULTS[f] for f in missing if f in GPU_DEFAULTS}
        hardware = handler(data)
        hardware._defaulted = missing
        return hardware

    @property
    def defaulted(self) -> tuple[str, ...]:
        """The calibrated constants the profile did not set, which took their defaults."""
        return self._defaulted

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def memory_per_device_bytes(self) -> int:
        return int(self.memory_per_device_gib * GIB)

    @property
    def device_overhead_bytes(self) -> int:
        """Per-device memory the planner reserves before training tensors (see the two fields)."""
        return int(self.device_overhead_gib * GIB + self.fragmentation * self.memory_per_device_bytes)

    @property
    def threads_per_rank(self) -> int | None:
        """Intra-op threads of one CPU rank (the launcher gives each its share of the cores)."""
        if not self.shared_compute or not self.host_cores:
            return None
        return max(1, self.host_cores // self.devices_per_node)

    def gemm_fraction(self, gemm_flops: float) -> float:
        """Fraction of the rank's peak a GEMM of `gemm_flops` FLOPs reaches: the measured curve for
        the rank's thread count, interpolated in log FLOPs (clamped at its ends), else the constant
        matmul_efficiency."""
        one_thread = self.threads_per_rank == 1 and self.host_cores > 1  # a rank per core
        curve = (self.gemm_efficiency_one_thread if one_thread else None) or self.gemm_efficiency
        if not curve or gemm_flops <= 0:
            return self.matmul_efficiency
        points = sorted(curve)
        if gemm_flops <= points[0][0]:
            return points[0][1]
        for (f0, e0), (f1, e1) in zip(points, points[1:], strict=False):
            if gemm_flops <= f1:
                w = math.log(gemm_flops / f0) / math.log(f1 / f0)
                return e0 + w * (e1 - e0)
        return points[-1][1]

    @property
    def co_run_factor(self) -> float:
        """co_run_slowdown where CPU ranks share a node, else 1."""
        return self.co_run_slowdown if self.shared_compute and self.devices_per_node > 1 else 1.0

    def ranks_per_core_at(self, busy: float) -> float:
        """ranks_per_core when on average only `busy` of the node's ranks compute at once (1 - a
        pipeline's bubble): a rank waiting for its neighbour leaves its core to the others. Where
        each rank has its own cores (fewer ranks than cores) its threads are fixed, and nothing is
        gained."""
        if not self.shared_compute or not self.host_cores:
            return 1.0
        return max(1.0, self.devices_per_node * busy / self.host_cores)

    def co_run_factor_at(self, busy: float) -> float:
        """co_run_factor for work that runs beside the node's other ranks only about `busy` of the
        time (1 - a pipeline's bubble; the probe measures every rank busy at once)."""
        return 1.0 + (self.co_run_factor - 1.0) * busy

    @property
    def ranks_per_core(self) -> float:
        """How many ranks time-share one core (1 unless shared_compute with more ranks than cores)."""
        if not self.shared_compute or not self.host_cores:
            return 1.0
        return max(1.0, self.devices_per_node / self.host_cores)

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s of one rank at the training precision (fp32 training uses TF32 where the profile has it)."""
        tflops = {
            "fp32": self.peak_tflops.tf32 or self.peak_tflops.fp32,
            "bf16": self.peak_tflops.bf16,
            "fp16": self.peak_tflops.fp16,
        }[precision] or self.peak_tflops.fp32
        per_device = tflops * 1e12
        return per_device / self.devices_per_node if self.shared_compute else per_device
