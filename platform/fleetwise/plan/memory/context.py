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


@dataclass(frozen=True)
class RankContext:
    cfg: RunConfig
    layout: Layout
    chunks: list[list[Unit]]  # every chunk of the pipeline
    rank: int  # this pipeline rank
    n: int  # micro-batches per step
    engine: Engine
    schedule: PipelineSchedule
    local: list[int]  # the chunks this rank holds
    units: list[UnitGroup]  # their units, equal ones once with their count
    p: float  # parameters on this rank (after the mp split, before sharding)
    block_params: float  # of which the blocks' (the rest is the root's: embedding, head, norm)
    k: int  # optimizer state tensors per parameter
    offloaded: bool  # FSDP's CPUOffloadPolicy on a GPU
    act: ActivationBytes
    flight: dict[int, int]  # micro-batches in flight per local chunk, at the peak
    # interleaved zero bubble: per local chunk, those waiting for their weight step at the peak
    # (pipeline.weight_steps_waiting); empty for every other schedule
    waiting: dict[int, int]
    cool: CoolDown | None  # ZB-V's cool-down moment (pipeline.zbv_cool_down)

    @property
    def strategy(self) -> CollectiveStrategy:
        s = self.cfg.strategy
        assert isinstance(s, CollectiveStrategy)
        return s

    @property
    def mp(self) -> int:
        return self.layout.mp

    @property
    def sh(self) -> int:
        return self.layout.sharding

    @property
    def b(self) -> int:
        return self.cfg.train.micro_batch_size

    @property
    def mixed(self) -> bool:
        return self.cfg.train.precision != "fp32"

    @property
    def pipelined(self) -> bool:
        return self.layout.pp > 1

    @property
    def accumulating(self) -> bool:
        """Gradients accumulate over micro-batches: several of them, or a pipeline schedule."""
        return self.n > 1 or self.pipelined

    @property
    def gather_bytes(self) -> int:
        """FSDP MixedPrecisionPolicy gathers in the compute dtype."""
        return compute_bytes(self.cfg.train.precision)

    @property
    def fresh(self) -> float:
        """Bytes per element of a parameter's fresh gradient before autograd adds it into .grad:
        while gradients accumulate (DDP's no_sync, no data parallelism, and FSDP under a pipeline
        schedule, which reduces once after the last micro-batch); ZeRO-1's hook adds it into its
        fp32 buffer, in every micro-batch; FSDP without a pipeline reduce-scatters each unit's
        gradients instead (its buffers are in the working parameters)."""
        if self.engine == Engine.ZERO1:
            return FP32 if not self.mixed else 2
        if self.engine == Engine.FSDP:
            return self.gather_bytes if self.pipelined else 0.0
        return FP32 if self.accumulating else 0.0

    @property
    def seq_shard(self) -> int:
        """Under sequence parallelism a stage sends, receives and holds its sequence shard."""
        return self.mp if self.strategy.sequence_parallel else 1

    def saved_bytes(self, a: Acts) -> float:
        """Bytes per sample, on this rank, of activations `a`."""
        mp, sp = self.mp, self.strategy.sequence_parallel
        split_bytes, whole_bytes = self.act
        return (
            (a.split / mp) * split_bytes
            + (a.sp / mp if sp else a.sp) * whole_bytes
            + a.whole * whole_bytes
            + (a.reduced / mp if sp else a.reduced) * split_bytes
            + (a.fp32 / mp) * FP32
            + a.partial * split_bytes
        )


def rank_context(
    cfg: RunConfig, layout: Layout, chunks: list[list[Unit]], ranks: list[int], rank: int, n: int
) -> RankContext:
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    mp, pipelined = layout.mp, layout.pp > 1
    engine = dp_engine(layout, s.sharding_stage)
    local = [c for c, r in enumerate(ranks) if r == rank]
    # equal units once, with their count (a 96-layer chunk is a few classes: a search plans thousands)
    units = [g for c in local for g in unit_groups(chunks[c])]
    schedule = PipelineSchedule(s.schedule)
    return RankContext(
        cfg=cfg,
        layout=layout,
        chunks=chunks,
        rank=rank,
        n=n,
        engine=engine,
        schedule=schedule,
        local=local,
        units=units,
        p=sum(count * u.params_on_rank(mp) for u, count in units),
        block_params=sum(count * u.params_on_rank(mp) for u, count in units if u.kind == "block"),
        k=optimizer_state_factor(cfg.optim.name, cfg.optim.momentum),
        offloaded=s.offload and cfg.hardware.device_type == "cuda" and engine == Engine.FSDP,
        act=activation_bytes(cfg.train.precision, engine, family_of(cfg.model).convolutional),
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
