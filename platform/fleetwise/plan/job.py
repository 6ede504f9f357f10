"""What every part of a collective plan starts from: the layout, the data-parallel engine, the
micro-batches of a step and the model's units on the pipeline (plan/chunks.py)."""

from __future__ import annotations

from dataclasses import dataclass

from fleetwise.config.engine import Engine, dp_engine
from fleetwise.config.layout import Layout
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import CollectiveStrategy
from fleetwise.plan.chunks import assign_units
from fleetwise.plan.pipeline import PipelineSchedule, chunk_ranks
from fleetwise.plan.units import Unit


@dataclass(slots=True)
class Job:
    cfg: RunConfig
    strategy: CollectiveStrategy
    layout: Layout
    n: int  # micro-batches per step (per pipeline: its number of micro-batches)
    b: int  # the micro-batch size
    chunks: list[list[Unit]]  # the units of each pipeline chunk
    ranks: list[int]  # the pipeline rank of each chunk
    virtual: int  # chunks per pipeline rank (1 without pipelining)
    engine: Engine
    schedule: PipelineSchedule

    @classmethod
    def of(cls, cfg: RunConfig) -> Job:
        s = cfg.strategy
        assert isinstance(s, CollectiveStrategy)
        layout = Layout.of(cfg)
        v = s.virtual_stages if layout.pp > 1 else 1
        return cls(
            cfg=cfg,
            strategy=s,
            layout=layout,
            n=cfg.train.accumulate_steps or 1,
            b=cfg.train.micro_batch_size,
            chunks=assign_units(cfg, layout),
            ranks=chunk_ranks(s.schedule, layout.pp, v) if layout.pp > 1 else [0],
            virtual=v,
            engine=dp_engine(layout, s.sharding_stage),
            schedule=PipelineSchedule(s.schedule),
        )
