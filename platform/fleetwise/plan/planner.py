"""The analytic planner's front door: `make_plan(cfg)`, a validated config in, a `Plan` out --
memory per device, FLOPs, communication, bubble and step time.

Everything here is arithmetic on the validated config (no torch). Where each term lives, and
the sources of its formulas:
- Memory (plan/memory/): model states after ZeRO (Rajbhandari et al. 2020, section 3): fp32
  params 4 B, grads 4 B, optimizer k·4 B per parameter, divided by the sharding degree as each
  stage shards them; mapped onto what FSDP2 / DDP / fleetwise's ZeRO-1 actually keep (see
  config/engine.py). Activations: Korthikanti et al. 2022 per-layer accounting, redone for this
  engine (plan/units.py), times the micro-batches each pipeline schedule keeps in flight
  (plan/pipeline.py).
- FLOPs (plan/time.py): 2 FLOPs per multiply-add, training = 3 × forward (Kaplan et al. 2020;
  Narayanan et al. 2021 eq. 3 without recompute): 6·N·tokens + attention 12·L·s·h·tokens for
  transformers.
- Communication (plan/comm.py): ring collectives (all-reduce moves 2(n-1)/n of the buffer per
  device, all-gather and reduce-scatter (n-1)/n), Thakur et al. 2005.
- Time (plan/time.py): GEMMs at a fraction of peak that depends on their size, host time per op,
  element, parameter tensor and schedule action, stretched by the pipeline bubble; plus the
  communication that is not overlapped with compute, the parameter update and offload's host
  traffic. `fleetwise calibrate` measures the constants.
- The parameter server's plan is plan/ps.py's.
"""

from __future__ import annotations

from typing import Any

from fleetwise.config.engine import Engine
from fleetwise.config.layout import Layout
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import PSStrategy
from fleetwise.families import family_of
from fleetwise.plan.chunks import (
    RankRole,
    block_recomputes,
    local_chunks,
    rank_roles,
    rank_units,
    unit_groups,
)
from fleetwise.plan.comm import stage_comm_bytes
from fleetwise.plan.job import Job
from fleetwise.plan.memory.ranks import RankMemory, memory_of, memory_ranks
from fleetwise.plan.ps import ps_plan
from fleetwise.plan.records import Memory, Plan
from fleetwise.plan.time import StepTime, device_flops_per_sample, model_flops_per_step, step_time


def make_plan(cfg: RunConfig, memory: RankMemory | None = None, per_stage: bool = True) -> Plan:
    """Plan a resolved, valid config. `memory`: `rank_memory(cfg)` of this same config, when the
    caller has it already (a layout search asks it first). `per_stage=False`: without
    `plan.stages` (each pipeline stage's memory, FLOPs and traffic; a search ranks layouts by the
    rest), so the ranks that cannot hold the most memory are not planned; all else is the same."""
    if isinstance(cfg.strategy, PSStrategy):
        return ps_plan(cfg)
    return collective_plan(cfg, memory, per_stage)


def collective_plan(cfg: RunConfig, memory: RankMemory | None = None, per_stage: bool = True) -> Plan:
    """A collective layout's plan: the pipeline ranks' memory (plan/memory/), the worst of them,
    every stage's time and the step (plan/time.py, plan/comm.py), then the record."""
    job = Job.of(cfg)
    roles = rank_roles(job.chunks, job.ranks, job.layout.pp)
    # without the stages, only the ranks that can hold the most memory are planned (the worst is
    # one of them); the others' parameters are all the time model needs of them
    if per_stage:
        planned = range(job.layout.pp)
    else:  # those of `memory` (rank_memory's) when given
        planned = (
            memory.keys()
            if memory is not None
            else memory_ranks(job.strategy, job.layout, job.chunks, job.ranks, job.n)
        )
    memory = memory_of(cfg, job.layout, job.chunks, job.ranks, job.n, sorted(planned), memory, roles)
    rank_params = _rank_params(job, memory)
    worst = max(sorted(memory), key=lambda r: memory[r].memory.total)
    timing = step_time(job, roles, rank_params, worst)
    stages = _stages(job, roles, memory, rank_params, timing) if per_stage else []
    peak = memory[worst].memory  # the worst device's
    return _plan(job, peak, timing, stages, _notes(job, peak, timing))


def _rank_params(job: Job, memory: RankMemory) -> list[float]:
    """Each pipeline rank's parameters (after the mp split): its memory's, else its units'."""
    chunks_of = local_chunks(job.ranks, job.layout.pp)
    return [
        memory[r].params
        if r in memory
        else sum(
            count * u.params_on_rank(job.layout.mp, job.strategy.ep_degree)
            for c in chunks_of[r]
            for u, count in unit_groups(job.chunks[c])
        )
        for r in range(job.layout.pp)
    ]


def _stages(
    job: Job, roles: list[RankRole], memory: RankMemory, rank_params: list[float], timing: StepTime
) -> list[dict[str, Any]]:
    """Each pipeline stage's memory, FLOPs and traffic (`plan.stages`)."""
    layout, chunks, ranks, engine = job.layout, job.chunks, job.ranks, job.engine
    again = block_recomputes(job.schedule, layout.pp, chunks)
    comm_of: dict[RankRole, dict[str, int]] = {}  # per role, like the work
    stages = []
    for r in range(layout.pp):
        if roles[r] not in comm_of:
            comm_of[roles[r]] = stage_comm_bytes(
                job.cfg, layout, chunks, ranks, rank_params[r], r, job.n, engine, again
            )
        mem = memory[r].memory
        stages.append(
            {
                "rank": r,
                "chunks": [c for c, rr in enumerate(ranks) if rr == r],
                "layers": sum(1 for u in rank_units(chunks, ranks, r) if u.kind == "block"),
                "params_per_device": int(
                    rank_params[r] / (layout.sharding * layout.cp if engine == Engine.FSDP else 1)
                ),
                "memory_total_bytes": int(mem.total),
                "host_memory_bytes": int(mem.host),  # offloaded state (GPU offload only)
                "memory_peak": mem.peak_ints(),  # this stage's peak phase and its parts
                "flops_per_device": timing.stages[r].device_flops,  # per step, recompute included
                # bytes this device sends per step, by mesh dimension (pp differs by stage)
                "comm_bytes_per_step": dict(comm_of[roles[r]]),
                "compute_s": timing.stages[r].compute,
            }
        )
    return stages


def _notes(job: Job, mem: Memory, timing: StepTime) -> list[str]:
    cfg, s, t = job.cfg, job.strategy, job.cfg.train
    notes = []
    if s.offload and cfg.hardware.device_type == "cpu":
        notes.append("offload keeps state in host memory, which on a CPU device is the same memory")
    elif mem.host:
        notes.append(
            f"offload: {mem.host / 2**30:.2f} GiB of host memory per device at most (sharded params, grads, "
            "optimizer state and the optimizer step), not counted in the device's peak"
        )
    notes += family_of(cfg.model).plan_notes(cfg.model)
    again = block_recomputes(job.schedule, job.layout.pp, job.chunks)
    if s.recompute != "none" and max(again.values(), default=1) > 1:
        notes.append(_recomputed_twice(job, timing))
    if cfg.hardware.backend == "nccl":
        notes.append(communicators_note(job))
    if cfg.optim.warmup_steps > t.steps:
        notes.append(
            f"optim.warmup_steps={cfg.optim.warmup_steps} > train.steps={t.steps}: the warm-up is cut "
            f"short and the learning rate only reaches {t.steps}/{cfg.optim.warmup_steps} of optim.lr"
        )
    return notes


def nccl_communicators(layout: Layout) -> dict[str, int]:
    """The NCCL communicators a rank of `layout` creates at start-up, by group, and their ranks:
    the world's (runtime/mesh.py binds the device in init_process_group: created at once, not at
    the first collective), then one per mesh dimension that does not span the world -- torch's
    DeviceMesh splits the world's communicator once per dimension (ncclCommSplit), a dimension of
    one rank included; a dimension of all the ranks reuses the world's (torch 2.13's
    `_init_one_process_group`). Pipeline sends may add a communicator per neighbour pair later."""
    world = layout.world_size
    return {"world": world} | {d: n for d, n in zip(layout.dims, layout.shape, strict=True) if n != world}


def communicators_note(job: Job) -> str:
    """What the plan assumes of NCCL's own memory: how many communicators each rank holds, and that
    their buffers are not in the memory total."""
    groups = nccl_communicators(job.layout)
    dims = ", ".join(f"{d} {n}" for d, n in groups.items() if d != "world")
    overhead = job.cfg.hardware.device_overhead_gib
    return (
        f"NCCL: {len(groups)} communicator(s) per rank at start-up (world {groups['world']} rank(s)"
        + (f"; mesh {dims}" if dims else "")
        + "); their buffers (NCCL_BUFFSIZE per channel and peer; NVLS on NVSwitch) are outside PyTorch's "
        f"allocator and not in the memory total: only hardware.device_overhead_gib ({overhead:g} GiB, "
        "estimated, not measured on a multi-GPU node) leaves room for them"
    )


def _recomputed_twice(job: Job, timing: StepTime) -> str:
    """The note on zero bubble's recompute in both backward passes, with what it costs."""
    s, mp, n, b = job.strategy, job.layout.mp, job.n, job.b
    chunks_of = local_chunks(job.ranks, job.layout.pp)
    once = [
        sum(
            count * n * b * device_flops_per_sample(u, s.recompute, mp) / mp
            for c in chunks_of[r]
            for u, count in unit_groups(job.chunks[c])
        )
        for r in range(job.layout.pp)
    ]
    done = [st.device_flops for st in timing.stages]
    extra = max(d / o - 1 for d, o in zip(done, once, strict=True) if o)
    return (
        f"strategy.schedule={s.schedule} with strategy.recompute={s.recompute}: torch's zero-bubble "
        "backward re-runs each checkpointed block in both its input- and weight-gradient passes "
        f"(not the first chunk): +{extra:.0%} FLOPs on the busiest stage, counted in the step time; "
        "1F1B or interleaved_1F1B recompute once"
    )


def _plan(job: Job, mem: Memory, timing: StepTime, stages: list[dict[str, Any]], notes: list[str]) -> Plan:
    cfg, layout, t, hw = job.cfg, job.layout, job.cfg.train, job.cfg.hardware
    flops_per_step = model_flops_per_step(cfg, job.chunks)
    params = sum(count * u.params for c in job.chunks for u, count in unit_groups(c))
    active = sum(count * u.active_params for c in job.chunks for u, count in unit_groups(c))
    peak = hw.peak_flops(t.precision)
    step = timing.step
    tokens = family_of(cfg.model).tokens_per_sample(cfg.model)
    device_mem = hw.memory_per_device_bytes
    return Plan(
        world_size=layout.world_size,
        mesh=layout.as_dict(),
        params=int(params),
        batch={
            "global_batch_size": t.global_batch_size,
            "micro_batch_size": job.b,
            "accumulate_steps": job.n,
            "num_microbatches": job.n,
        },
        memory_bytes=mem.as_ints(),
        memory_peak=mem.peak_ints(),
        device_memory_bytes=device_mem,
        fits=mem.total <= device_mem - hw.device_overhead_bytes,
        device_overhead_bytes=hw.device_overhead_bytes,
        usable_memory_bytes=device_mem - hw.device_overhead_bytes,
        flops_per_step=float(flops_per_step),
        bubble_fraction=timing.bubble_fraction,
        step_time_s=step,
        mfu=flops_per_step / (step * layout.world_size * peak) if step > 0 else 0.0,
        device_peak_flops=peak,
        engine=job.engine.value,
        precision=t.precision,
        samples_per_s=t.global_batch_size / step if step else 0.0,
        tokens_per_s=t.global_batch_size * tokens / step if step else 0.0,
        comm_bytes_per_step={k: int(v) for k, v in timing.comm_bytes.items()},
        time_s=timing.time_s(),
        stages=stages,
        notes=notes,
        active_params=int(active) if active != params else None,
    )
