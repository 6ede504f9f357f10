"""What one pipeline rank's memory depends on: its chunks and units, the engine and precision, the
micro-batches it keeps in flight. Worked out once per rank (`rank_context`) and read by every term
of plan/memory/."""

from __future__ import annotations

from dataclasses import dataclass

from fleetwise.config.engine import Engine, dp_engine, optimizer_state_factor
from fleetwise.config.layout import Layout
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import CollectiveStrategy
from fleetwise.families import family_of
from fleetwise.plan.chunks import UnitGroup, unit_groups
from fleetwise.plan.dtypes import FP32, ActivationBytes, activation_bytes, compute_bytes
from fleetwise.plan.pipeline import (
    CoolDown,
    PipelineSchedule,
    chunks_in_flight,
    weight_steps_waiting,
    zbv_cool_down,
)
from fleetwise.plan.units import Acts, Unit


@dataclass(slots=True)
class RankContext:
    cfg: RunConfig
    strategy: CollectiveStrategy
    layout: Layout
    chunks: list[list[Unit]]  # every chunk of the pipeline
    rank: int  # this pipeline rank
    n: int  # micro-batches per step
    b: int  # micro-batch size
    mp: int
    ep: int  # expert-parallel ranks (strategy.ep_degree): the routed experts are split over them
    sh: int
    engine: Engine
    schedule: PipelineSchedule
    local: list[int]  # the chunks this rank holds
    units: list[UnitGroup]  # their units, equal ones once with their count
    p: float  # parameters on this rank (after the mp split, before sharding)
    # of which FSDP keeps this many between steps: p / sh, except that expert-parallel experts
    # (their E / ep on this rank) are FSDP-sharded over the edp = sharding × dp / ep ranks outside
    # their group, not over sharding (runtime/expert_parallel.py)
    p_shard: float
    block_params: float  # of which the blocks' (the rest is the root's: embedding, head, norm)
    k: int  # optimizer state tensors per parameter
    mixed: bool  # bf16 or fp16
    pipelined: bool
    accumulating: bool  # gradients accumulate over micro-batches: several of them, or a pipeline
    offloaded: bool  # FSDP's CPUOffloadPolicy on a GPU
    gather_bytes: int  # FSDP MixedPrecisionPolicy gathers in the compute dtype
    # Bytes per element of a parameter's fresh gradient before autograd adds it into .grad: while
    # gradients accumulate (DDP's no_sync, no data parallelism, and FSDP under a pipeline
    # schedule, which reduces once after the last micro-batch); ZeRO-1's hook adds it into its
    # fp32 buffer, in every micro-batch; FSDP without a pipeline reduce-scatters each unit's
    # gradients instead (its buffers are in the working parameters)
    fresh: float
    act: ActivationBytes
    seq_shard: int  # under sequence parallelism a stage sends, receives and holds its sequence shard
    cp: int  # context parallelism: this rank holds 1/cp of every sequence's tokens
    flight: dict[int, int]  # micro-batches in flight per local chunk, at the peak
    # interleaved zero bubble: per local chunk, those waiting for their weight step at the peak
    # (pipeline.weight_steps_waiting); empty for every other schedule
    waiting: dict[int, int]
    cool: CoolDown | None  # ZB-V's cool-down moment (pipeline.zbv_cool_down)

    def saved_bytes(self, a: Acts) -> float:
        """Bytes per sample, on this rank, of activations `a` (1/cp of the tokens of each sample)."""
        mp, sp = self.mp, self.strategy.sequence_parallel
        split_bytes, whole_bytes = self.act
        return (
            (a.split / mp) * split_bytes
            + (a.sp / mp if sp else a.sp) * whole_bytes
            + a.whole * whole_bytes
            + (a.reduced / mp if sp else a.reduced) * split_bytes
            + (a.fp32 / mp) * FP32
            + (a.sp32 / mp if sp else a.sp32) * FP32
            + (a.partial + a.replicated) * split_bytes
        ) / self.cp


def rank_context(
    cfg: RunConfig, layout: Layout, chunks: list[list[Unit]], ranks: list[int], rank: int, n: int
) -> RankContext:
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    mp, pipelined, mixed = layout.mp, layout.pp > 1, cfg.train.precision != "fp32"
    engine = dp_engine(layout, s.sharding_stage)
    local = [c for c, r in enumerate(ranks) if r == rank]
    # equal units once, with their count (a 96-layer chunk is a few classes: a search plans thousands)
    units = [g for c in local for g in unit_groups(chunks[c])]
    schedule = PipelineSchedule(s.schedule)
    accumulating = n > 1 or pipelined
    gather_bytes = compute_bytes(cfg.train.precision)
    if engine == Engine.ZERO1:
        fresh = FP32 if not mixed else 2
    elif engine == Engine.FSDP:
        fresh = gather_bytes if pipelined else 0.0
    else:
        fresh = FP32 if accumulating else 0.0
    sh = layout.sharding * (layout.cp if engine == Engine.FSDP else 1)
    p = sum(count * u.params_on_rank(mp, s.ep_degree) for u, count in units)
    experts = sum(count * u.expert_params for u, count in units) / s.ep_degree if s.ep_degree > 1 else 0.0
    edp = layout.sharding * layout.dp // s.ep_degree
    return RankContext(
        cfg=cfg,
        strategy=s,
        layout=layout,
        chunks=chunks,
        rank=rank,
        n=n,
        b=cfg.train.micro_batch_size,
        mp=mp,
        ep=s.ep_degree,
        # FSDP shards over sharding × cp (cp ranks hold the same parameters: config/layout.py)
        sh=sh,
        engine=engine,
        schedule=schedule,
        local=local,
        units=units,
        p=p,
        p_shard=(p - experts) / sh + experts / edp if engine == Engine.FSDP else p / sh,
        block_params=sum(count * u.params_on_rank(mp, s.ep_degree) for u, count in units if u.kind == "block"),
        k=optimizer_state_factor(cfg.optim.name, cfg.optim.momentum),
        mixed=mixed,
        pipelined=pipelined,
        accumulating=accumulating,
        offloaded=s.offload and cfg.hardware.device_type == "cuda" and engine == Engine.FSDP,
        gather_bytes=gather_bytes,
        fresh=fresh,
        act=activation_bytes(cfg.train.precision, engine, family_of(cfg.model).convolutional),
        seq_shard=mp if s.sequence_parallel else 1,
        cp=layout.cp,
        flight=chunks_in_flight(s.schedule, layout.pp, s.virtual_stages if pipelined else 1, n, rank),
        # Interleaved zero bubble: every rank peaks in a weight step on its last local chunk
        # (pipeline.weight_steps_waiting), with micro-batches waiting for theirs (rank 0 too: its
        # first chunk's one full backward is not the moment; gpt/tiny pp 2 v 2, 16 layers, rank 0
        # was -7.0%)
        waiting=weight_steps_waiting(s.schedule, layout.pp, s.virtual_stages, n, rank) if pipelined else {},
        # ZB-V's cool-down moment (pipeline.zbv_cool_down): per local chunk, one micro-batch's saved
        # activations and the output gradients it keeps from its input-gradient step to its weight step
        cool=zbv_cool_down(layout.pp, n, rank)
        if pipelined and schedule == PipelineSchedule.ZBV_ZERO_BUBBLE
        else None,
    )
