"""Every hardware constant `fleetwise calibrate` measures: one row each, the single list that ties
a constant's profile key to what measures it and to what the planner charges with it.

A row names the `hardware` config field (and profile key), its unit, its defaults (what a profile
without the key gets, by device type), what it means in one line, the probes that measure it
(functions under fleetwise.calibrate.probes, named as strings so that this module stays
torch-free) and the planner term that uses it: the planner reads `cfg.hardware.<reads>`, the
field itself unless a HardwareConfig method derives the term from it.

What else follows from these rows, and the test that holds each to them
(tests/unit/calibrate/test_registry.py):
- config/hardware.py: a field per row, its default the row's CPU default, GPU_DEFAULTS the GPU
  ones; every other field is a DESCRIBED one (what the profile says the machine is);
- conf/hardware_keys.yaml and every conf/hardware/*.yaml: the key;
- the profile writer (calibrate/profile.py) writes every row, in this order;
- plan/ reads `.<reads>`: a constant nothing charges is caught.

A new constant is one row here, its field in config/hardware.py, its key in every profile, a
probe, and the planner term; the test fails while any of them is missing.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

PROBES = "fleetwise.calibrate.probes"


@dataclass(frozen=True)
class Constant:
    """One measured hardware constant."""

    field: str  # the HardwareConfig field and profile key
    unit: str  # what the number counts ("" for a plain ratio)
    default: Any  # what a profile without the key gets on a CPU (the schema's default)
    gpu_default: Any  # ... on a GPU (device_type cuda)
    meaning: str  # one line
    probes: tuple[str, ...]  # functions under PROBES that measure it (module.function)
    planner: str  # the term the planner charges with it
    reads: str = ""  # the HardwareConfig attribute plan/ reads, when not the field itself
    unmeasured: str = ""  # no probe: why, and where the value comes from

    @property
    def read_as(self) -> str:
        return self.reads or self.field

    def default_for(self, device_type: str) -> Any:
        return self.gpu_default if device_type == "cuda" else self.default

    def describe(self, value: Any) -> str:
        """`value` with its unit, as a profile reads it ("null" for None)."""
        if value is None:
            return "null"
        return f"{value} {self.unit}".rstrip() if not isinstance(value, list) else str(value)


def _host(field: str, unit: str, cpu: float, meaning: str, probe: str, planner: str) -> Constant:
    """A host cost: measured on CPUs, 0 on GPUs, where the host's work queues kernels and overlaps
    them (calibrate on a GPU writes 0)."""
    return Constant(field, unit, cpu, 0.0, meaning, (probe,), planner)


ROWS: tuple[Constant, ...] = (
    Constant(
        "intra_node_gbps",
        "GB/s",
        2.0,
        450.0,
        "bus bandwidth of an all-reduce inside a node (ring volume per direction; NCCL: the best of 16-256 MiB)",
        ("collectives.allreduce_speed",),
        "comm: bytes of each collective inside a node over it",
    ),
    Constant(
        "inter_node_gbps",
        "GB/s",
        1.25,
        50.0,
        "bandwidth of an all-reduce between nodes, one rank per node",
        ("collectives.inter_node_speed",),
        "comm: bytes of each collective whose group spans nodes over it",
    ),
    Constant(
        "inter_node_latency_us",
        "µs",
        None,
        None,
        "fixed cost of one collective call between nodes (null: comm_latency_us)",
        ("collectives.inter_node_speed",),
        "comm: per call of a collective whose group spans nodes",
    ),
    Constant(
        "matmul_efficiency",
        "",
        0.5,
        0.5,
        "fraction of peak a training-shaped GEMM reaches (where no gemm_efficiency curve is set)",
        ("compute.training_gemm_flops",),
        "time: every GEMM's FLOPs at this fraction of peak without a curve (and a PS trainer's)",
    ),
    Constant(
        "comm_latency_us",
        "µs",
        20.0,
        20.0,
        "fixed cost of one collective call (a 4-byte all-reduce between 2 processes)",
        ("collectives.allreduce_speed",),
        "comm: per collective call, and the P2P latency of a pipeline's sends",
    ),
    Constant(
        "reduce_scatter_gbps",
        "GB/s",
        None,
        None,
        "bandwidth of a reduce-scatter on its ring volume (null: intra_node_gbps)",
        ("collectives.allreduce_speed",),
        "comm: ZeRO and FSDP's reduce-scatters, per byte against an all-reduce's",
    ),
    Constant(
        "all_gather_gbps",
        "GB/s",
        None,
        None,
        "bandwidth of an all-gather on its ring volume (null: intra_node_gbps)",
        ("collectives.allreduce_speed",),
        "comm: ZeRO and FSDP's all-gathers, per byte against an all-reduce's",
    ),
    Constant(
        "op_overhead_us",
        "µs",
        12.0,
        10.0,
        "host time per forward op with its backward (dispatch, autograd; on a GPU the kernel floor)",
        ("host.op_overhead_us", "gpu.gpu_costs"),
        "time: host_ops, every forward op of every unit and micro-batch",
    ),
    Constant(
        "elementwise_ns",
        "ns",
        2.0,
        0.0054,
        "time per element a non-GEMM op writes, forward with its backward",
        ("host.elementwise_ns", "gpu.gpu_costs"),
        "time: elementwise, per element the units' non-GEMM ops write",
    ),
    Constant(
        "grad_accumulate_ns",
        "ns",
        1.2,
        0.0036,
        "time per gradient element added into a step's accumulated gradient (in-place fp32 add)",
        ("host.grad_accumulate_ns", "gpu.gpu_costs"),
        "time: grad_accumulate, per micro-batch's gradients added, and ZeRO-1's buffer passes",
    ),
    _host(
        "update_us_per_tensor",
        "µs",
        30.0,
        "host time of the update (norm, clipping, AdamW) per parameter tensor",
        "host.update_cost",
        "time: update, per parameter tensor a rank owns",
    ),
    _host(
        "update_ns_per_param",
        "ns",
        1.2,
        "the same update's time per parameter element",
        "host.update_cost",
        "time: update, per parameter element a rank owns",
    ),
    _host(
        "conv_call_us",
        "µs",
        250.0,
        "extra host time per convolution call, forward with its backward",
        "host.conv_call_us",
        "time: host_ops, per convolution of each unit and micro-batch",
    ),
    _host(
        "checkpoint_op_us",
        "µs",
        10.0,
        "extra host time per forward op of a fully checkpointed block beyond re-running it",
        "host.checkpoint_op_us",
        "time: recompute=full, per forward op of a checkpointed unit",
    ),
    _host(
        "selective_checkpoint_op_us",
        "µs",
        45.0,
        "the same for selective checkpointing (its policy sees every op twice)",
        "host.checkpoint_op_us",
        "time: recompute=selective, per forward op of a checkpointed unit",
    ),
    _host(
        "zero_bubble_split_op_us",
        "µs",
        38.0,
        "extra host time per forward op of a block whose backward a zero-bubble schedule splits",
        "pipeline.zero_bubble_split_cost",
        "time: zero-bubble schedules, per forward op of each split chunk",
    ),
    _host(
        "zero_bubble_split_ns_per_param",
        "ns",
        0.44,
        "the same split's extra time per parameter of the block",
        "pipeline.zero_bubble_split_cost",
        "time: zero-bubble schedules, per parameter of each split chunk",
    ),
    _host(
        "dtensor_op_us",
        "µs",
        450.0,
        "extra host time per forward op of a tensor-parallel (DTensor) module",
        "parallel.dtensor_op_us",
        "time: host_ops, per forward op of a tensor-parallel unit",
    ),
    _host(
        "fsdp_us_per_tensor",
        "µs",
        550.0,
        "extra host time of FSDP per unit pass and parameter tensor (hooks, waiting for the peer)",
        "parallel.fsdp_us_per_tensor",
        "time: host_ops, per FSDP unit, micro-batch and parameter tensor",
    ),
    _host(
        "fsdp_ns_per_param",
        "ns",
        3.0,
        "FSDP's copies into and out of its collective buffers, per element and all-gather or reduce-scatter",
        "parallel.fsdp_ns_per_param",
        "time: per parameter element of each FSDP all-gather and reduce-scatter",
    ),
    _host(
        "pipeline_action_us",
        "µs",
        250.0,
        "host time torch.distributed.pipelining spends per schedule action beyond compute and latency",
        "pipeline.pipeline_action_us",
        "time: per pipeline schedule action (forward, backward, weight pass)",
    ),
    _host(
        "pipeline_multi_action_us",
        "µs",
        450.0,
        "extra per forward and input-gradient action of the multi-stage schedules",
        "pipeline.pipeline_action_us",
        "time: per sending action of interleaved and zero-bubble schedules",
    ),
    _host(
        "zero1_us_per_tensor",
        "µs",
        17.0,
        "ZeRO-1's host work per parameter tensor and micro-batch (its gradient hook)",
        "parallel.zero1_host_us",
        "time: host_ops, per parameter tensor and micro-batch under ZeRO-1",
    ),
    _host(
        "zero1_step_us_per_tensor",
        "µs",
        30.0,
        "ZeRO-1's host work per parameter tensor and optimizer step (bookkeeping, norms, copies)",
        "parallel.zero1_host_us",
        "time: update, per parameter tensor under ZeRO-1",
    ),
    Constant(
        "co_run_slowdown",
        "×",
        1.1,
        1.0,
        "how much slower a CPU rank's work gets with every core running a rank in lockstep",
        ("host.co_run_slowdown",),
        "time: a CPU node's ranks' compute and host work, scaled by the share of time they co-run",
        reads="co_run_factor",
    ),
    Constant(
        "host_link_gbps",
        "GB/s",
        None,
        None,
        "host <-> device bandwidth per device, pinned, the harmonic mean of both directions (null: offload is not charged)",
        ("gpu.host_link",),
        "time: offload, the offloaded parameters and gradients crossing it every step",
    ),
    Constant(
        "offload_update_ns_per_param",
        "ns",
        0.0,
        1.0,
        "host time of the optimizer step per offloaded parameter element",
        (),
        "time: offload, the optimizer step on the host per offloaded parameter",
        unmeasured="an estimate (AdamW's bytes over a GPU process's share of host memory bandwidth); "
        "the profile writer writes the default",
    ),
    Constant(
        "gemm_efficiency",
        "",
        None,
        None,
        "(FLOPs of one GEMM, fraction of peak) points, one rank on all cores (null: matmul_efficiency)",
        ("compute.gemm_curve", "gpu.gpu_costs"),
        "time: each GEMM at the interpolated fraction of peak for its size",
        reads="gemm_fraction",
    ),
    Constant(
        "gemm_efficiency_one_thread",
        "",
        None,
        None,
        "the same points for a one-thread rank (a rank per core)",
        ("compute.gemm_curve",),
        "time: each GEMM of a one-thread rank, as gemm_efficiency",
        reads="gemm_fraction",
    ),
)

BY_FIELD: dict[str, Constant] = {row.field: row for row in ROWS}


def defaulted_notes(hardware: Any) -> list[str]:
    """One line per calibrated key the hardware profile did not set (HardwareConfig.defaulted):
    which default the planner uses instead, and how to get the measured value."""
    out = []
    for name in hardware.defaulted:
        row = BY_FIELD[name]
        value = row.describe(row.default_for(hardware.device_type))
        fix = (
            f"set hardware.{name}=… to change it"
            if row.unmeasured
            else "run `fleetwise calibrate` again to measure it"
        )
        out.append(
            f"hardware/{hardware.name}.yaml has no {name} (written by an older calibrate): "
            f"using the default {value}; {fix}"
        )
    return out


@functools.cache  # once per process: a sweep plans the same profile at every point
def _print_once(note: str) -> None:
    print(f"note: {note}", file=sys.stderr)


def note_defaults(hardware: Any) -> None:
    """Print (to stderr, each once) the defaulted_notes of a validated hardware config: what
    `plan`, `validate` and `train` say about a profile that lacks a calibrated key."""
    for note in defaulted_notes(hardware):
        _print_once(note)
