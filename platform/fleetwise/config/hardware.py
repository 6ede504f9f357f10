"""Where a job runs: the `hardware` config group (device, backend, counts, speeds, memory)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleetwise.config.base import Section

GIB = 1024**3


class PeakTflops(Section):
    """Dense peak throughput of one device per dtype, in TFLOP/s (vendor datasheet, no sparsity)."""

    fp32: float = Field(gt=0, description="Plain fp32 FMA throughput.")
    tf32: float | None = Field(None, gt=0, description="TF32 tensor-core throughput (null: none).")
    bf16: float | None = Field(None, gt=0, description="bf16 throughput (null: no bf16 support).")
    fp16: float | None = Field(None, gt=0, description="fp16 throughput.")


class HardwareConfig(Section):
    name: str = Field(description="Profile name (cpu, v100, a100, h100, or a calibrated local profile).")
    device_type: Literal["cpu", "cuda"] = Field(description="torch device type of one rank.")
    backend: Literal["gloo", "nccl"] = Field(description="torch.distributed backend.")
    nodes: int = Field(1, ge=1, description="Machines in the job.")
    devices_per_node: int = Field(
        ge=1, description="Ranks per machine (GPUs, or processes on a CPU machine)."
    )
    memory_per_device_gib: float = Field(gt=0, description="Memory one rank may use, GiB.")
    peak_tflops: PeakTflops
    has_bf16: bool = Field(
        description="Whether bf16 arithmetic is native (V100: no; AVX2-only CPUs: emulated)."
    )
    intra_node_gbps: float = Field(
        gt=0, description="Per-device bandwidth inside a node, GB/s per direction."
    )
    inter_node_gbps: float = Field(
        gt=0, description="Per-device bandwidth between nodes, GB/s per direction."
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
    op_overhead_us: float = Field(
        0.0,
        ge=0,
        description="Host time per forward op (dispatch, autograd, Python) with its backward, microseconds "
        "(calibrate measures it; 0 on GPUs, where kernels queue behind the device's work).",
    )
    host_cores: int | None = Field(
        None,
        ge=1,
        description="CPU cores the ranks of a node share (shared_compute); more ranks than cores time-share them.",
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def memory_per_device_bytes(self) -> int:
        return int(self.memory_per_device_gib * GIB)

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
