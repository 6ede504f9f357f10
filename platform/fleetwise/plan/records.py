"""What the planner answers: `Plan` (what `fleetwise plan --json` prints and `plan.json` holds) and
`Memory` (one rank's peak and what it is made of), and `step_parts`, the plan's step time as terms
that add up to it.

Plain records, no arithmetic of their own beyond their own fields: the memory model is in
plan/memory/, the time model in plan/time.py, the communication in plan/comm.py, and
plan/planner.py (`make_plan`) fills them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class Memory:
    """Bytes one device holds at its peak, by kind (the plan's `memory_bytes`)."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    inputs: float = 0.0  # the step's batch this rank holds (all its micro-batches)
    pipeline_buffers: float = 0.0  # pipeline receive buffers and held outputs (runtime/pipeline_stage.py)
    step_temporaries: float = 0.0  # the optimizer step's own temporaries (foreach AdamW: one per param)
    total: float = 0.0
    # offload on a GPU (FSDP CPUOffloadPolicy): the peak of the host RAM this rank's offloaded state
    # takes -- sharded fp32 params, grads, optimizer state and the optimizer step's temporaries,
    # which run on the host. Not device memory, so not part of `total`
    host: float = 0.0
    # what is live at the peak: the phase and its parts, which add up to `total` (plan.memory_peak)
    peak: dict[str, Any] = field(default_factory=dict)

    def as_ints(self) -> dict[str, int]:
        # (not dataclasses.asdict, which deep-copies `peak`: a search asks this of thousands)
        return {f.name: int(round(getattr(self, f.name))) for f in fields(self) if f.name != "peak"}

    def peak_ints(self) -> dict[str, Any]:
        parts = self.peak.get("parts", {})
        return {"phase": self.peak.get("phase", ""), "parts": {k: int(round(v)) for k, v in parts.items()}}


@dataclass
class Plan:
    """A job's plan: the contract's keys (README, `fleetwise plan --json`) first, then the detail."""

    world_size: int
    mesh: dict[str, int]
    params: int
    batch: dict[str, int]
    memory_bytes: dict[str, int]
    device_memory_bytes: int
    fits: bool  # memory_bytes["total"] <= usable_memory_bytes
    flops_per_step: float
    bubble_fraction: float
    step_time_s: float
    mfu: float
    # beyond the contract
    device_overhead_bytes: int = 0  # context, NCCL, cuBLAS, fragmentation (hardware.device_overhead_*)
    usable_memory_bytes: int = 0  # device_memory_bytes - device_overhead_bytes
    device_peak_flops: float = 0.0  # peak FLOP/s of one device at the training precision (MFU's denominator)
    engine: str = "none"  # the data-parallel engine (config/engine.py Engine), or "ps"
    precision: str = "fp32"
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    comm_bytes_per_step: dict[str, int] = field(default_factory=dict)
    time_s: dict[str, float] = field(default_factory=dict)
    stages: list[dict[str, Any]] = field(default_factory=list)
    ps: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    # the worst device's peak: {"phase": "forward/backward" | "backward" (GPipe) | "loss backward" |
    # "root re-gather" (ZeRO-3) | "block backward" (ZeRO-2) | "root reduce-scatter" (FSDP) |
    # "end of backward" | "optimizer step" | "the fullest server" | "a trainer", "parts": {name: bytes}},
    # the parts adding up to memory_bytes["total"]
    memory_peak: dict[str, Any] = field(default_factory=dict)
    # a mixture of experts: the parameters one token uses (FLOPs and MFU count these); None for a
    # dense model (then left out of the JSON: every parameter is active)
    active_params: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["active_params"] is None:
            del out["active_params"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan back from its JSON (plan.json): `Plan.from_dict(p.to_dict()) == p`. Keys this
        version does not know (e.g. `remedies` of `plan --json`) are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


COMPUTE_PARTS = ("host_ops", "elementwise", "grad_accumulate")  # time_s keys inside time_s["compute"]


def step_parts(time_s: dict[str, float]) -> dict[str, float]:
    """A plan's `time_s` as terms that add up to its step time.

    `time_s["compute"]` (the slowest stage's micro-batches) includes that stage's `host_ops`,
    `elementwise` and `grad_accumulate`, and `comm_hidden` is the part of the dp and sharding
    communication that runs behind compute. Here compute is split into its GEMMs and those parts,
    and dp + sharding communication appears once, as what stays exposed (`comm_exposed_dp`,
    `comm_exposed_sharding`: the hidden time taken off in proportion)."""
    t = dict(time_s)
    parts: dict[str, float] = {}
    if "compute" in t:
        inner = {k: t.pop(k, 0.0) for k in COMPUTE_PARTS}
        parts["gemm"] = t.pop("compute") - sum(inner.values())
        parts.update(inner)
    hidden = t.pop("comm_hidden", 0.0)
    overlappable = {k: t.pop(k) for k in ("comm_dp", "comm_sharding") if k in t}
    total = sum(overlappable.values())
    for k, v in overlappable.items():
        parts[k.replace("comm_", "comm_exposed_")] = v - hidden * v / total if total else 0.0
    parts.update(t)  # bubble, comm_mp, comm_pp, comm_ps, update, offload
    return parts
