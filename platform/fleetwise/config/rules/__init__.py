"""Pass 2 of validation: rules across config sections, one module per section.

A rule takes a `Context` (the config and, when it could be derived, its layout) and yields
`Problem`s naming the config path, the values and a fix. Every rule runs, so a user sees every
mistake at once; they run in the order their modules are imported below (strategy, model,
train, launch), which is the order problems are listed in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fleetwise.config.layout import Layout
from fleetwise.config.problems import Problem
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import CollectiveStrategy, PSStrategy


@dataclass(frozen=True)
class Context:
    """What rules need beyond the config: the resolved layout when it could be derived."""

    cfg: RunConfig
    layout: Layout | None
    launching: bool = False  # rules about starting processes apply only to `train`

    @property
    def collective(self) -> CollectiveStrategy | None:
        s = self.cfg.strategy
        return None if isinstance(s, PSStrategy) else s


Rule = Callable[[Context], Iterator[Problem]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def num_microbatches(cfg: RunConfig, layout: Layout | None) -> int | None:
    """Micro-batches per step per data-parallel rank, given or derived from the batch triad."""
    t = cfg.train
    if t.accumulate_steps is not None:
        return t.accumulate_steps
    ranks = data_parallel_ranks(cfg, layout)
    if ranks is None:
        return None
    per_rank = t.micro_batch_size * ranks
    return t.global_batch_size // per_rank if t.global_batch_size % per_rank == 0 else None


def data_parallel_ranks(cfg: RunConfig, layout: Layout | None) -> int | None:
    if isinstance(cfg.strategy, PSStrategy):
        return cfg.strategy.num_trainers
    return layout.data_parallel_size if layout else None


# The rule modules register themselves on import, in this order.
from fleetwise.config.rules import strategy, model, train, launch  # noqa: E402, F401, I001
