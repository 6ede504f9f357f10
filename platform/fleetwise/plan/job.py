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


@dataclass(frozen=True)
class Job:
    cfg: RunConfig
    layout: Layout
    n: int  # micro-batches per step (per pipeline: its number of micro-batches)
    chunks: list[list[Unit]]  # the units of each pipeline chunk
    ranks: list[int]  # the pipeline rank of each chunk
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
            layout=layout,
            n=cfg.train.accumulate_steps or 1,
            chunks=assign_units(cfg, layout),
            ranks=chunk_ranks(s.schedule, layout.pp, v) if layout.pp > 1 else [0],
            engine=dp_engine(layout, s.sharding_stage),
            schedule=PipelineSchedule(s.schedule),
        )

    @property
    def strategy(self) -> CollectiveStrategy:
        s = self.cfg.strategy
        assert isinstance(s, CollectiveStrategy)
        return s

    @property
    def b(self) -> int:
        """The micro-batch size."""
        return self.cfg.train.micro_batch_size

    @property
    def virtual(self) -> int:
        """Chunks per pipeline rank (1 without pipelining)."""
        return self.strategy.virtual_stages if self.layout.pp > 1 else 1
