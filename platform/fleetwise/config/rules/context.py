"""What a rule sees and how rules register: `Context` (the config, its layout when it could be
derived, which command asks), `@rule` and `RULES`; and the batch arithmetic that rules and
`config/validate.py resolve` share.

A rule takes a `Context` and yields `Problem`s naming the config path, the values and a fix.
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
    # The whole validation (config/validate.py `check`), for a rule that checks a config derived
    # from this one (every node count of an elastic job). Handed in, so that no rule imports the
    # validator that runs it.
    check: Callable[[RunConfig], list[Problem]]
    launching: bool = False  # rules about starting processes apply only to `train` (and `dryrun`)
    # `fleetwise dryrun`: its own refusals apply (rules/dryrun.py), and the launch section's do not
    # (a dry run starts no rendezvous: ports and node ranks mean nothing to it)
    dryrun: bool = False

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
