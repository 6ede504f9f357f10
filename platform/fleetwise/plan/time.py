"""Time: FLOPs, each pipeline stage's compute, and the step time.

- FLOPs: 2 FLOPs per multiply-add, training = 3 × forward (Kaplan et al. 2020; Narayanan et al.
  2021 eq. 3 without recompute): 6·N·tokens + attention 12·L·s·h·tokens for transformers. What a
  device computes besides (recompute, flash attention's backward) is `device_flops_per_sample`.
- Compute: GEMMs at a fraction of peak that depends on their size (the calibrated curve; else
  `matmul_efficiency`), plus host time per op (`op_overhead_us` × the forward ops of each unit,
  backward included; more under tensor parallelism: `dtensor_op_us`, per convolution:
  `conv_call_us`, and per recomputed op: `checkpoint_op_us`) and per element the other
  ops write (`elementwise_ns`) and per gradient element a micro-batch adds into the step's
  (`grad_accumulate_ns`), stretched by the pipeline bubble (plan/pipeline.py); FSDP's host work
  per unit, micro-batch and parameter tensor (`fsdp_us_per_tensor`), ZeRO-1's per parameter tensor
  in every micro-batch (`zero1_us_per_tensor`: its gradient hook) and once a step
  (`zero1_step_us_per_tensor`); plus the parameter update once per step (a cost per tensor and per
  element). `fleetwise calibrate` measures all of these constants.
- Step: the slowest stage's compute over (1 - bubble), plus the communication that is not
  overlapped with compute (plan/comm.py: latency per call + bytes over bandwidth;
  `overlap_window`), the update and FSDP offload's host traffic (`offload_seconds`).
- CPU ranks that outnumber the cores (`host_cores`) time-share them: their host and communication
  time stretch by ranks per core (their FLOP/s share is already peak / ranks); ranks that share a
  node also slow each other down (`co_run_slowdown`, measured with every core running a rank in
  lockstep).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from fleetwise.config.engine import Engine, optimizer_state_factor
from fleetwise.config.layout import Layout
from fleetwise.config.run import RunConfig
from fleetwise.plan.cache import PLAN_CACHE
from fleetwise.plan.chunks import RankRole, block_recomputes, unit_groups
from fleetwise.plan.comm import collective_comm, comm_seconds, cp_hidden_seconds, fsdp_collectives
from fleetwise.plan.context_parallel import device_flops_per_sample as cp_device_flops
from fleetwise.plan.dtypes import FP32
from fleetwise.plan.job import Job
from fleetwise.plan.pipeline import bubble_fraction
from fleetwise.plan.units import Unit

# --------------------------------------------------------------------------------------------------
# FLOPs


def model_flops_per_step(cfg: RunConfig, chunks: list[list[Unit]]) -> float:
    """Model FLOPs of one optimizer step, whole job, no recompute counted: 3 × forward."""
    every = [g for c in chunks for g in unit_groups(c)]
    return cfg.train.global_batch_size * 3 * sum(count * u.fwd_flops for u, count in every)


def device_flops_per_sample(u: Unit, recompute: str, mp: int = 1, recomputes: int = 1) -> float:
    """FLOPs a device computes for one sample through unit `u` (before the mp split), as torch's
    FlopCounterMode counts them: matmuls forward once and backward twice; flash attention forward
    once and backward 2.5 times (it recomputes the scores); full recompute re-runs a block's
    forward up to the last tensor its backward needs (`recompute_skipped_flops`); selective
    recompute under TP re-runs the row-parallel matmuls it keeps the reduced outputs of.
    `recomputes`: how many times the backward re-runs the block (`block_recomputes`)."""
    dense = u.fwd_flops - u.attn_flops
    done = 3 * dense + 3.5 * u.attn_flops
    if recompute == "full" and u.kind == "block":
        done += recomputes * (u.fwd_flops - u.recompute_skipped_flops)
    if recompute == "selective" and mp > 1:
        done += recomputes * u.selective_tp_recompute_flops
    return done


# --------------------------------------------------------------------------------------------------
# What each kind of host work costs on this layout's ranks


@dataclass(slots=True)
class Sharing:
    """How ranks sharing a node's cores run the micro-batches. Ranks sharing a CPU node's cores
    (shared_compute) time-share them and slow each other down, but a pipeline rank waiting in its
    bubble leaves its core to the others: the micro-batches' work runs with only (1 - bubble) of
    the node's ranks busy at once, on average. The optimizer step, after the schedule, has them all
    (gpt/tiny pp 4 on 2 cores measured 36 ms, where 2 ranks per core on top of its bubble planned
    70 ms). GPUs: both are 1."""

    per_core: float  # ranks per core while the micro-batches run
    slow: float  # their co-run slowdown
    gemm_share: float  # of the node's FLOP/s (peak_flops is the node's over all its ranks)

    @classmethod
    def of(cls, cfg: RunConfig, bubble: float) -> Sharing:
        hw = cfg.hardware
        per_core = hw.ranks_per_core_at(1 - bubble)
        return cls(per_core, hw.co_run_factor_at(1 - bubble), per_core / hw.ranks_per_core)


@dataclass(slots=True)
class OpCosts:
    """Seconds per op, element and recomputed op of a micro-batch's forward and backward."""

    op_s: float  # per forward op (its backward included)
    elem_s: float  # per element the non-matmul ops write
    checkpoint_s: float  # per forward op of a recomputed block: checkpointing's own machinery

    @classmethod
    def of(cls, cfg: RunConfig, layout: Layout, sharing: Sharing) -> OpCosts:
        hw, per_core, slow = cfg.hardware, sharing.per_core, sharing.slow
        # under tensor parallelism every op of every unit goes through DTensor (measured on 2 ranks
        # running together: its co-run slowdown is in it already)
        dtensor_us = hw.dtensor_op_us if layout.mp > 1 else 0.0
        # activation checkpointing's own machinery per forward op of a recomputed block, on top of
        # the re-run ops (selective checkpointing's policy dispatch mode costs more than full)
        checkpoint_us = {"none": 0.0, "full": hw.checkpoint_op_us, "selective": hw.selective_checkpoint_op_us}
        return cls(
            op_s=(slow * hw.op_overhead_us + dtensor_us) * 1e-6 * per_core,
            elem_s=slow * hw.elementwise_ns * 1e-9 * per_core,
            checkpoint_s=slow * checkpoint_us[cfg.strategy.recompute] * 1e-6 * per_core,
        )


@dataclass(slots=True)
class EngineCosts:
    """The data-parallel engine's own host work, and the step's per-element passes it makes."""

    fsdp_s: float  # FSDP, per unit, micro-batch and parameter tensor
    fsdp_copy_s: float  # FSDP's copies into and out of its flat buffers, per parameter and step
    zero1_s: float  # ZeRO-1's gradient hook, per parameter tensor and micro-batch
    zero1_step_s: float  # ZeRO-1, per parameter tensor once a step
    adds: int  # gradient accumulations per step
    accumulated_share: float  # of the rank's gradients each accumulation adds
    accumulate_s: float  # per gradient element and accumulation
    step_pass_s: float  # per element of a memory-bound pass at the optimizer step
    gather_passes: float  # ZeRO-1's passes over its whole bucket once a step

    @classmethod
    def of(cls, job: Job, sharing: Sharing) -> EngineCosts:
        hw, layout, engine, n, per_core = job.cfg.hardware, job.layout, job.engine, job.n, sharing.per_core
        fsdp, zero1 = engine == Engine.FSDP, engine == Engine.ZERO1
        gathers, scatters = (
            fsdp_collectives(job.strategy, layout, n) if fsdp and layout.sharding > 1 else (0, 0)
        )
        return cls(
            # FSDP's host work (its hooks, the copies into and out of the flat collective buffers)
            # runs for every unit in every micro-batch's forward and backward, whatever the ZeRO
            # stage; measured on co-running ranks like DTensor's. A stage-3 re-gather adds only its
            # collective's latency.
            fsdp_s=hw.fsdp_us_per_tensor * 1e-6 * per_core if fsdp else 0.0,
            # ... and its copies into and out of the flat collective buffers (the all-gather's
            # copy-in of the shard and copy-out into the unsharded parameters, the reduce-scatter's
            # concatenation of the gradients and copy-out of the shard): memory-bound passes over
            # the unit's parameters at each of its all-gathers and reduce-scatters, which the
            # per-tensor probe (width 16) cannot see. On a 6-layer d=512 GPT (19M parameters, 2 CPU
            # ranks) ZeRO-2 ran ~300 ms a step behind DDP where the plan had ~120 ms; calibrate's
            # probe (units of 8.4M parameters) reads 2.3-3.5 ns per element and collective on that
            # machine, ~110 ms a micro-batch there.
            fsdp_copy_s=(gathers + scatters) * hw.fsdp_ns_per_param * 1e-9 * per_core,
            # ZeRO-1's own host work (runtime/zero1.py), measured on co-running ranks like FSDP's: a
            # Python gradient hook per parameter tensor in every micro-batch's backward, and per
            # tensor once a step the reduce's bookkeeping, the squared norms of its pieces and the
            # all-gather's copies
            zero1_s=hw.zero1_us_per_tensor * 1e-6 * per_core if zero1 else 0.0,
            zero1_step_s=hw.zero1_step_us_per_tensor * 1e-6 * hw.ranks_per_core if zero1 else 0.0,
            # gradient accumulation: each micro-batch's gradient is added into the step's, a
            # memory-bound pass over the rank's gradients (every micro-batch into ZeRO-1's fp32
            # buffer, whose hook also takes the first; under DDP autograd adds micro-batches 2..n
            # into .grad; FSDP without a pipeline reduce-scatters each micro-batch's and adds the
            # shard, with one it accumulates them whole)
            adds=n if zero1 else n - 1,
            accumulated_share=1 / layout.sharding if (fsdp and layout.pp == 1) else 1.0,
            accumulate_s=sharing.slow * hw.grad_accumulate_ns * 1e-9 * per_core,
            # (ZeRO-1's per-step passes below run at the optimizer step, every rank busy)
            step_pass_s=hw.co_run_factor * hw.grad_accumulate_ns * 1e-9 * hw.ranks_per_core,
            # ZeRO-1's gather is memory-bound work over the whole bucket once a step, charged per
            # element like an accumulation pass: this rank's masters copied into its row and the
            # other rows copied out into the working weights (a pass in all), and on gloo first the
            # zeroing of the buffer it all-reduces (runtime/zero1.py)
            gather_passes=(2.0 if hw.backend == "gloo" else 1.0) if zero1 else 0.0,
        )


@dataclass(slots=True)
class PipelineCosts:
    """torch.distributed.pipelining's own host work."""

    actions: int  # schedule actions per local chunk and micro-batch
    action_s: float  # per action
    multi_s: float  # more per sending action of a multi-stage schedule
    split: bool  # the backward is split in two (zero bubble)
    split_op_s: float  # the weight-gradient pass, per forward op
    split_param_s: float  # ... and per parameter

    @classmethod
    def of(cls, job: Job, sharing: Sharing) -> PipelineCosts:
        hw, per_core, slow, pipelined = job.cfg.hardware, sharing.per_core, sharing.slow, job.layout.pp > 1
        multi = job.schedule.multi_stage and pipelined
        return cls(
            # a micro-batch's pass through one local stage with its send/receive: forward and
            # backward, and zero-bubble schedules split the backward into input- and
            # weight-gradient actions. Measured on co-running stages, like DTensor's.
            actions=(3 if job.schedule.zero_bubble else 2) if pipelined else 0,
            action_s=hw.pipeline_action_us * 1e-6 * per_core,
            # torch's multi-stage schedules (PipelineScheduleMulti: the interleaved and zero-bubble
            # ones) pay more per action that sends and receives (a forward, a backward or
            # input-gradient pass) than the single-stage 1F1B that `pipeline_action_us` is measured
            # on (calibrate's interleaved probe; gpt/tiny pp 2, interleaved 1F1B v 2, measured 1.73x
            # its plan where 1F1B and ZB-V ran 1.46-1.50x)
            multi_s=hw.pipeline_multi_action_us * 1e-6 * per_core if multi else 0.0,
            # ... and the zero-bubble split itself: torch's input-gradient pass keeps the graph for
            # the weight-gradient pass, which walks it again (host time per forward op) and makes a
            # memory-bound pass over the chunk's weights, in every chunk but the first (which torch
            # runs as one full backward). Measured by calibrate on fleetwise's own block; a 6-layer
            # d=512 GPT on 2 CPU ranks ran ~4 ms per block and micro-batch longer under interleaved
            # zero bubble than 1F1B.
            split=job.schedule.zero_bubble and pipelined,
            split_op_s=slow * hw.zero_bubble_split_op_us * 1e-6 * per_core,
            split_param_s=slow * hw.zero_bubble_split_ns_per_param * 1e-9 * per_core,
        )


@dataclass(slots=True)
class HostCosts:
    """What each kind of host work costs on this layout's ranks (one plan)."""

    sharing: Sharing
    ops: OpCosts
    engine: EngineCosts
    pipeline: PipelineCosts

    @classmethod
    def of(cls, job: Job, bubble: float) -> HostCosts:
        sharing = Sharing.of(job.cfg, bubble)
        ops = OpCosts.of(job.cfg, job.layout, sharing)
        return cls(sharing, ops, EngineCosts.of(job, sharing), PipelineCosts.of(job, sharing))


# --------------------------------------------------------------------------------------------------
# One pipeline rank's work


@dataclass(slots=True)
class RankWork:
    """What one pipeline rank computes: per step its GEMM seconds and device FLOPs; per
    micro-batch its ops, elements written, convolutions, parameter tensors, local chunks, and the
    ops and parameters whose backward zero bubble splits."""

    gemm_s: float = 0.0
    device_flops: float = 0.0
    forward_ops: int = 0
    redo_ops: int = 0  # ops re-run by recompute
    elements: float = 0
    convs: int = 0
    tensors: int = 0
    local_chunks: int = 0
    split_ops: int = 0
    split_params: float = 0.0

    @property
    def ops(self) -> int:
        """Ops dispatched, the re-run ones included."""
        return self.forward_ops + self.redo_ops


@dataclass(slots=True)
class ComputeModel:
    """What the ranks' work is worked out from, for one plan."""

    job: Job
    peak: float  # FLOP/s of one device at the training precision
    split: bool  # zero bubble splits the backward
    again: dict[int, int]  # block_recomputes
    recompute: str  # strategy.recompute
    recompute_extra: float  # forward passes full recompute adds to a block's backward, per re-run
    gemm_fractions: dict[Hashable, float] = field(default_factory=dict)  # per class of equal units

    @classmethod
    def of(cls, job: Job, split: bool) -> ComputeModel:
        cfg, recompute = job.cfg, job.strategy.recompute
        return cls(
            job=job,
            peak=cfg.hardware.peak_flops(cfg.train.precision),
            split=split,
            again=block_recomputes(job.schedule, job.layout.pp, job.chunks),
            recompute=recompute,
            recompute_extra={"none": 0.0, "selective": 0.0, "full": 1.0}[recompute],
        )

    def gemm_fraction(self, u: Unit, flops: float) -> float:
        """The fraction of peak the unit's GEMMs run at (their average size), once per class."""
        key = PLAN_CACHE.class_of(u)
        fraction = self.gemm_fractions.get(key)
        if fraction is None:
            fraction = self.job.cfg.hardware.gemm_fraction(flops / max(1, u.fwd_gemms))
            self.gemm_fractions[key] = fraction
        return fraction


def rank_work(model: ComputeModel, r: int) -> RankWork:
    """The work of pipeline rank `r` (equal units once: `again` is per chunk)."""
    job, work = model.job, RankWork()
    mp, b = job.layout.mp, job.b
    for c in (c for c, rr in enumerate(job.ranks) if rr == r):
        work.local_chunks += 1
        for u, count in unit_groups(job.chunks[c]):
            # both recompute modes re-run every op of a block in backward (selective reads
            # saved matmul results back, but still dispatches the ops); zero bubble: twice
            rerun = model.again[id(u)] if model.recompute != "none" and u.kind == "block" else 0
            _count_ops(work, u, count, rerun, model.split and c > 0, mp)
            # one micro-batch's forward on this rank (a MoE block's MLP in full on every mp rank)
            flops = b * ((u.fwd_flops - u.replicated_flops) / mp + u.replicated_flops)
            if flops:
                _add_gemms(work, model, u, count, flops)
    return work


def _count_ops(work: RankWork, u: Unit, count: int, rerun: int, split: bool, mp: int) -> None:
    work.forward_ops += count * u.fwd_ops
    work.redo_ops += count * rerun * u.fwd_ops
    work.elements += count * (1 + rerun) * u.fwd_elementwise
    work.convs += count * (1 + rerun) * u.fwd_convs
    work.tensors += count * u.param_tensors
    if split:
        work.split_ops += count * u.fwd_ops
        work.split_params += count * u.params_on_rank(mp)


def _add_gemms(work: RankWork, model: ComputeModel, u: Unit, count: int, flops: float) -> None:
    """The unit's GEMM seconds and device FLOPs, all micro-batches: forward, backward (2 ×
    forward) and full recompute's re-run forwards. `flops`: one micro-batch's forward on this rank."""
    mp, n, b = model.job.layout.mp, model.job.n, model.job.b
    again = model.again[id(u)]
    passes = 3 + (model.recompute_extra * again if u.kind == "block" else 0.0)
    fraction = model.gemm_fraction(u, flops)
    work.gemm_s += count * n * passes * flops / (model.peak * fraction)
    per_sample = device_flops_per_sample(u, model.recompute, mp, again)
    if model.job.layout.cp > 1:  # this rank's share of every sample (plan/context_parallel.py)
        reruns = again if model.recompute == "full" and u.kind == "block" else 0
        per_sample = cp_device_flops(model.job.cfg, model.job.layout, u, per_sample, reruns)
    whole = replicated_device_flops(u, model.recompute, again)  # (computed in full on every mp rank)
    work.device_flops += count * n * b * ((per_sample - whole) / mp + whole)


def replicated_device_flops(u: Unit, recompute: str, recomputes: int = 1) -> float:
    """Of `device_flops_per_sample`, those of the unit's `replicated_flops` (a MoE block's MLP,
    whole on every mp rank): forward once, backward twice, and full recompute's re-run up to the
    skipped tail (the shared experts' down projection, itself replicated)."""
    if not u.replicated_flops:
        return 0.0
    done = 3 * u.replicated_flops
    if recompute == "full" and u.kind == "block":
        done += recomputes * (u.replicated_flops - u.recompute_skipped_flops)
    return done


# --------------------------------------------------------------------------------------------------
# Each stage's time


@dataclass(slots=True)
class StageTime:
    """One pipeline stage's time per step."""

    host_ops: float
    elementwise: float
    grad_accumulate: float
    compute: float  # its GEMMs (shared cores) and the three above
    update: float  # the parameter update, per tensor and element (before `update_scale`)
    engine_step: float  # ZeRO-1's own work once a step
    device_flops: float  # this device's FLOPs per step, recompute included


def host_ops_seconds(cfg: RunConfig, costs: HostCosts, work: RankWork, n: int, params: float) -> float:
    """Host time per step: each op, convolution and parameter tensor in every micro-batch, the
    schedule's actions, zero bubble's split backward; FSDP's buffer copies per parameter."""
    per_core, slow = costs.sharing.per_core, costs.sharing.slow
    o, e, p = costs.ops, costs.engine, costs.pipeline
    return (
        n
        * (
            work.ops * o.op_s
            + work.redo_ops * o.checkpoint_s
            + work.convs * slow * cfg.hardware.conv_call_us * 1e-6 * per_core
            + work.tensors * (e.fsdp_s + e.zero1_s)
            + p.actions * work.local_chunks * p.action_s
            + 2 * work.local_chunks * p.multi_s
            + work.split_ops * p.split_op_s
        )
        + params * e.fsdp_copy_s
    )


def accumulate_seconds(costs: HostCosts, work: RankWork, n: int, params: float) -> float:
    """Gradient accumulation's passes over the rank's gradients, and zero bubble's weight pass."""
    e = costs.engine
    return (
        e.adds * params * e.accumulated_share * e.accumulate_s
        + n * work.split_params * costs.pipeline.split_param_s
    )


def update_seconds(cfg: RunConfig, work: RankWork, params: float, update_shard: int) -> float:
    """The parameter update (gradient norm, clipping, optimizer step) once per step, per tensor and
    per element (before `update_scale`)."""
    hw = cfg.hardware
    elements_updated = params / update_shard
    return work.tensors * hw.update_us_per_tensor * 1e-6 + elements_updated * hw.update_ns_per_param * 1e-9


def stage_time(job: Job, costs: HostCosts, work: RankWork, params: float) -> StageTime:
    n, cp = job.n, job.layout.cp  # a cp rank computes 1/cp of every sample's tokens
    host = host_ops_seconds(job.cfg, costs, work, n, params)
    elementwise = n * job.b * work.elements * costs.ops.elem_s / cp
    accumulate = accumulate_seconds(costs, work, n, params)
    e = costs.engine
    return StageTime(
        host_ops=host,
        elementwise=elementwise,
        grad_accumulate=accumulate,
        compute=costs.sharing.slow * costs.sharing.gemm_share * work.gemm_s / cp
        + host
        + elementwise
        + accumulate,
        update=update_seconds(
            job.cfg, work, params, job.layout.sharding * cp if job.engine.shards_optimizer else 1
        ),
        engine_step=work.tensors * e.zero1_step_s + e.gather_passes * params * e.step_pass_s,
        device_flops=work.device_flops,
    )


def update_scale(cfg: RunConfig) -> float:
    """The update was calibrated with AdamW: scaled by the state tensors the optimizer reads and
    writes (param and grad, plus k state tensors: SGD does less), on every rank at once."""
    hw = cfg.hardware
    k = optimizer_state_factor(cfg.optim.name, cfg.optim.momentum)
    return (2 + k) / 4 * hw.ranks_per_core * hw.co_run_factor


# --------------------------------------------------------------------------------------------------
# The step


def overlap_window(engine: Engine, layout: Layout, n: int, compute: float) -> float:
    """Compute time a step's data-parallel communication can hide behind, per engine.

    - DDP / ZeRO-1 under gradient accumulation (`no_sync`): the buckets are all-reduced during the
      last micro-batch's backward only, 2/3 of one micro-batch's compute (backward = 2 × forward).
    - FSDP under a pipeline schedule gathers once before the first micro-batch's forward and
      reduce-scatters after the last one's backward: one micro-batch's compute in all.
    - FSDP without a pipeline gathers and reduce-scatters every unit in every micro-batch, prefetched
      behind the unit before it: the whole compute.
    `compute` is the step's compute on the slowest stage (all its micro-batches)."""
    per_micro = compute / max(1, n)
    if engine == Engine.DDP:
        return (2 / 3) * per_micro
    if engine == Engine.ZERO1:  # its reduce-scatter and all-gather run after the backward, not behind it
        return 0.0
    if engine == Engine.FSDP and layout.pp > 1:
        return per_micro
    return compute


def offload_seconds(job: Job, p: float) -> float:
    """Offloaded FSDP (CPUOffloadPolicy): each rank's parameter shard (of its `p` parameters)
    crosses to the device for every all-gather and its gradient shard back after every
    reduce-scatter (fp32, over the host link), and the optimizer step runs on the host. Not
    overlapped: FSDP2 copies on the compute stream."""
    s, hw = job.strategy, job.cfg.hardware
    if not (s.offload and job.engine == Engine.FSDP and hw.device_type == "cuda"):
        return 0.0
    shard = p / job.layout.sharding
    gathers, scatters = fsdp_collectives(s, job.layout, job.n)
    link = (FP32 * shard * (gathers + scatters)) / (hw.host_link_gbps * 1e9) if hw.host_link_gbps else 0.0
    return link + shard * hw.offload_update_ns_per_param * 1e-9


@dataclass(slots=True)
class StepTime:
    """A step's time, term by term (the plan's `time_s`)."""

    bubble_fraction: float
    stages: list[StageTime]  # per pipeline rank
    slowest: StageTime  # the stage whose compute is the step's (the first of equal ones)
    pipelined_compute: float  # the slowest stage's compute stretched by the bubble
    comm: dict[str, float]  # seconds per mesh dimension (plan/comm.py)
    comm_bytes: dict[str, float]
    hidden: float  # dp and sharding communication hidden behind compute
    update: float
    offload: float
    step: float
    cp_hidden: float = 0.0  # the ring's steps hidden behind its blocks' attention (plan/comm.py)

    def time_s(self) -> dict[str, float]:
        compute = self.slowest.compute
        return {
            "compute": compute,
            "host_ops": self.slowest.host_ops,
            "elementwise": self.slowest.elementwise,
            "grad_accumulate": self.slowest.grad_accumulate,
            "bubble": self.pipelined_compute - compute,
            **{f"comm_{k}": v for k, v in self.comm.items()},
            # dp and sharding traffic hidden behind compute, and the ring's steps behind its blocks
            "comm_hidden": self.hidden + self.cp_hidden,
            "update": self.update,
            "offload": self.offload,
        }


def step_time(job: Job, roles: list[RankRole], rank_params: list[float], worst: int) -> StepTime:
    """Every stage's time (ranks in the same role, the inner ranks of a deep pipeline, do the same
    work: counted once), the communication of the rank with the most memory (`worst`), the step."""
    cfg, layout, n = job.cfg, job.layout, job.n
    bubble = bubble_fraction(job.schedule, layout.pp, job.virtual, n)
    stages = stage_times(job, roles, rank_params, bubble)
    scale = update_scale(cfg)
    update = max(st.update * scale + st.engine_step for st in stages)
    slowest = max(stages, key=lambda st: st.compute)
    compute = slowest.compute
    pipelined_compute = compute / (1 - bubble) if bubble < 1 else compute
    comm = collective_comm(cfg, layout, job.chunks, job.ranks, rank_params[worst], n, job.engine)
    seconds = comm_seconds(cfg, layout, comm)
    # Gradient all-reduce / reduce-scatter and FSDP gathers overlap with compute on GPUs (NCCL runs
    # on its own stream), but only with the compute that runs while they are in flight. On a CPU
    # the same cores run both, so nothing is hidden.
    # (the experts' own data-parallel reduction over edp is such traffic too)
    overlappable = seconds["dp"] + seconds["sharding"] + seconds.get("edp", 0.0)
    window = overlap_window(job.engine, layout, n, compute)
    hidden = min(overlappable, window) if cfg.hardware.device_type == "cuda" else 0.0
    # the experts' all-to-alls sit between the router and the experts, and ulysses' between the
    # projections and attention: nothing to hide behind; the ring's steps hide behind its blocks
    cp_hidden = min(seconds.get("cp", 0.0), cp_hidden_seconds(cfg, layout, n))
    exposed = (
        seconds["mp"]
        + seconds["pp"]
        + seconds.get("ep", 0.0)
        + seconds.get("cp", 0.0)
        - cp_hidden
        + overlappable
        - hidden
    )
    offload = offload_seconds(job, rank_params[worst])
    step = pipelined_compute + exposed + update + offload
    return StepTime(
        bubble,
        stages,
        slowest,
        pipelined_compute,
        seconds,
        comm.bytes,
        hidden,
        update,
        offload,
        step,
        cp_hidden,
    )


def stage_times(job: Job, roles: list[RankRole], rank_params: list[float], bubble: float) -> list[StageTime]:
    """Each pipeline stage's time; ranks in the same role do the same work (worked out once)."""
    costs = HostCosts.of(job, bubble)
    model = ComputeModel.of(job, costs.pipeline.split)
    work_of: dict[RankRole, RankWork] = {}
    stages = []
    for r in range(job.layout.pp):
        if roles[r] not in work_of:
            work_of[roles[r]] = rank_work(model, r)
        stages.append(stage_time(job, costs, work_of[roles[r]], rank_params[r]))
    return stages
